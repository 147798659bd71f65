"""The default project on a second, fresh worker against the first worker's store: `kiln build` (or, with
``--command nightly``, `kiln nightly`), cold vs second.

Each repeat makes one fresh ``file://`` artifact store and two fresh clones of this repository's HEAD (two
workers: each its own ``[build] cache_dir``, so its own empty unit and compile caches), with the same one-commit
edit in both: the store as ``[artifacts]`` and ``[build.cache] remote = "artifacts"`` (the shared tier). Then:

- ``cold``: worker A's ``kiln build``: every unit built, every translation unit compiled, both written to the
  shared tier;
- ``second_worker``: worker B's ``kiln build`` of the same commit: what A built is read from the shared tier.

With ``--command nightly`` each arm is a whole ``kiln nightly``: B's tests are carried from A's run where their
recorded inputs are unchanged (the selection records live in the same store), and each line says how many ran.

Each build is a fresh ``kiln build`` process against one Prefect server started for the benchmark (its start
is not timed), Kiln's daemon off: process start to exit. The ratio is ``second_worker``'s median over
``cold``'s, both measured in this run; each build's units by cache state and what the shared tier served (from its
run manifest) and the shared tier's size are printed beside them.

Usage::

    python benchmarks/bench_second_worker.py [--repeats 3] [--command build|nightly]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
WHEN = "2026-12-01T12:00:00+00:00"  # both clones' edit commits at one time: one commit id, one version


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_DATE": WHEN, "GIT_COMMITTER_DATE": WHEN, "GIT_AUTHOR_NAME": "bench",
           "GIT_AUTHOR_EMAIL": "bench@example.org", "GIT_COMMITTER_NAME": "bench",
           "GIT_COMMITTER_EMAIL": "bench@example.org"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env,
                          timeout=300).stdout.strip()


def worker(root: Path, name: str, store: Path) -> Path:
    """A clone of HEAD whose kiln.toml points at ``store`` with the shared tier on, committed; its kiln.toml."""
    clone = root / name
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], check=True, timeout=300)
    config = clone / "kiln.toml"
    text = config.read_text()
    text, found = re.subn(r'(?m)^url = "file://\.kiln/artifacts".*$', f'url = "{store.as_uri()}"', text, count=1)
    assert found == 1, "the default kiln.toml's [artifacts] url changed: update this benchmark"
    config.write_text(text + '\n[build.cache]\nremote = "artifacts"\n')
    _git(clone, "commit", "-q", "-am", "bench: a shared store and its cache tier")
    return config


def build(config: Path, env: dict[str, str], describe: Callable[[dict[str, Any]], str] | None = None,
          command: str = "build") -> tuple[float, str]:
    """One ``kiln <command>`` process of ``config``: its wall seconds and its run manifest as ``describe`` says it
    (by default: what its caches served)."""
    out = config.parent / "out"
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "kiln.flows.cli", command, "--config", str(config), "--out",
                           str(out)], cwd=config.parent, env=env, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"kiln {command} of {config} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")
    manifests = sorted(out.glob("*/run.json"), key=lambda p: p.stat().st_mtime)
    if not manifests:
        return seconds, "(no manifest)"
    return seconds, (describe or served)(json.loads(manifests[-1].read_text()))


def served(manifest: dict[str, Any]) -> str:
    """A run manifest's build units by cache state, and what the shared tier served and took."""
    states = Counter(str(u.get("cache")) for u in manifest["units"] if u.get("stage") == "build" and "cache" in u)
    shared = {k: v for k, v in manifest.get("info", {}).items() if k.startswith("build_cache_shared")}
    selection = [line for k, v in sorted(manifest.get("info", {}).items()) if k.startswith("selection:")
                 for line in (v if isinstance(v, list) else [v])]
    return (f"units by cache state {dict(sorted(states.items()))}; shared tier {shared}"
            + (f"; tests {selection}" if selection else ""))


def size_of(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def new_store(root: Path) -> Path:
    """A fresh owner-only ``file://`` store folder under ``root``."""
    store = root / "store"
    store.mkdir(parents=True)
    store.chmod(0o700)
    return store


def measured(times: dict[str, list[float]], repeat: int, arm: str, seconds: float, line: str) -> None:
    times[arm].append(seconds)
    print(f"repeat {repeat + 1} {arm}: {seconds:.1f} s; {line}", flush=True)


def repeat_done(root: Path, store: Path, repeat: int) -> None:
    """Print the shared store's size, then remove the repeat's folders."""
    print(f"repeat {repeat + 1}: shared store {size_of(store) / 1e6:.1f} MB", flush=True)
    shutil.rmtree(root, ignore_errors=True)


def _measure(tmp: Path, env: dict[str, str], repeats: int, times: dict[str, list[float]], command: str) -> None:
    for repeat in range(repeats):
        root = tmp / f"r{repeat}"
        store = new_store(root)
        first, second = worker(root, "a", store), worker(root, "b", store)
        assert _git(first.parent, "rev-parse", "HEAD") == _git(second.parent, "rev-parse", "HEAD")
        for arm, config in (("cold", first), ("second_worker", second)):
            measured(times, repeat, arm, *build(config, env, command=command))
        repeat_done(root, store, repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--command", choices=("build", "nightly"), default="build")
    args = parser.parse_args()
    from tests.helpers.prefect_server import prefect_server_process

    times: dict[str, list[float]] = {"cold": [], "second_worker": []}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-second-") as tmp:
        (Path(tmp) / "prefect-home").mkdir()
        with prefect_server_process(Path(tmp) / "prefect-home") as server:
            _measure(Path(tmp), {**server.env, "KILN_DAEMON": "off"}, args.repeats, times, args.command)
    cold, second = statistics.median(times["cold"]), statistics.median(times["second_worker"])
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cpus, Python {platform.python_version()}")
    print(f"cold: median {cold:.1f} s of {[round(t, 1) for t in times['cold']]}")
    print(f"second worker: median {second:.1f} s of {[round(t, 1) for t in times['second_worker']]}")
    print(f"ratio second/cold: {second / cold:.3f}")


if __name__ == "__main__":
    main()
