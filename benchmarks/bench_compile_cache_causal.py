"""causal-conv1d as published through the build caches: cold, a second worker, a one-line change in one `.cu`.

The package is causal-conv1d (the sdist pinned in tests/fixtures/real_packages.toml, sha256-checked), given its
``kiln.toml`` by ``kiln init`` (cu130 only, one arch, ``arch_policy = "narrow"``), then pointed at one fresh
``file://`` artifact store with ``[build.cache] remote = "artifacts"`` (the shared tier of the unit cache and of
the compile cache). Two workers are two clones of that commit at two paths, each with its own empty local caches
(the CUDA-torch build environment is shared, as tests/helpers/cuda_torch.py makes it, so no arm pays its install):

- ``cold``: worker A's ``kiln build``: nvcc compiles every translation unit; the unit and its objects go to the
  shared tier;
- ``second_worker``: worker B's ``kiln build`` of the same commit: what A built comes from the shared tier;
- ``one_file``: worker B after a one-line change in ``csrc/causal_conv1d_fwd.cu`` (a new commit): the pep517 unit
  misses, the compile cache's shared tier serves every translation unit but that one.

Each build is a fresh ``kiln build`` process against one Prefect server started for the benchmark, Kiln's daemon
off; process start to exit. One repeat by default: the cold build is about 20 minutes of nvcc on 2 cores. The
ratios are over the cold build of the same run; each build's unit message (its compile counts) and the shared
tier's counts and size are printed beside it.

Usage::

    python benchmarks/bench_compile_cache_causal.py [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
CHANGED = "csrc/causal_conv1d_fwd.cu"
MARK = "\n// kiln benchmark: a one-line change\nstatic __device__ int kiln_bench_changed_line = {n};\n"
ARMS = ("cold", "second_worker", "one_file")


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, timeout=300)


def _project(root: Path, store: Path) -> Path:
    """The pinned sdist, committed, given kiln init's kiln.toml, the shared store and its cache tier."""
    from kiln.flows.cli import main as kiln_main
    from tests.helpers.gitrepo import commit_all
    from tests.helpers.real_packages import committed_checkout, download_sdist, load_pin

    repo = committed_checkout(download_sdist(load_pin("causal-conv1d"), root / "sdist"))
    if kiln_main(["init", str(repo)]) != 0:
        raise SystemExit(f"kiln init {repo} failed")
    config = repo / "kiln.toml"
    text = config.read_text()
    if re.search(r"(?m)^\[artifacts\]", text):
        text = re.sub(r'(?ms)^(\[artifacts\].*?^url = )"[^"]*"', rf'\1"{store.as_uri()}"', text, count=1)
    else:
        text += f'\n[artifacts]\nurl = "{store.as_uri()}"\n'
    config.write_text(text + '\n[build.cache]\nremote = "artifacts"\n')
    commit_all(repo, "kiln init; a shared store and its cache tier")
    return repo


def _worker(source: Path, path: Path) -> Path:
    """A clone of ``source`` at ``path``, its build environments the shared CUDA-torch ones: its kiln.toml."""
    from tests.helpers.cuda_torch import link_shared_envs, shared_envs_root

    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(source), str(path)], check=True, timeout=300)
    link_shared_envs(path, shared_envs_root())
    return path / "kiln.toml"


def _build(config: Path, env: dict[str, str]) -> tuple[float, str]:
    """One ``kiln build`` of ``config``: its wall seconds, its pep517 unit's message and what the caches served."""
    from benchmarks.bench_second_worker import build, served

    def described(manifest: dict[str, Any]) -> str:
        units = manifest["units"]
        message = next((u.get("message", "") for u in units if str(u.get("id", "")).endswith("/pep517")), "")
        return f"{message}; {served(manifest)}"

    return build(config, env, described)


def _change(config: Path, n: int) -> None:
    source = config.parent / CHANGED
    source.write_text(source.read_text() + MARK.format(n=n))
    _git(config.parent, "commit", "-q", "-am", f"a one-line change in {CHANGED}")


def _repeat(tmp: Path, env: dict[str, str], n: int, times: dict[str, list[float]]) -> None:
    from benchmarks.bench_second_worker import measured, new_store, repeat_done

    root = tmp / f"r{n}"
    store = new_store(root)
    source = _project(root, store)
    first, second = _worker(source, root / "a"), _worker(source, root / "b")
    measured(times, n, "cold", *_build(first, env))
    measured(times, n, "second_worker", *_build(second, env))
    _change(second, n)
    measured(times, n, "one_file", *_build(second, env))
    repeat_done(root, store, n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    if shutil.which("nvcc") is None:
        raise SystemExit("nvcc is not on PATH: this benchmark builds causal-conv1d's CUDA extension")
    from tests.helpers.cuda_torch import shared_cuda_torch_env
    from tests.helpers.prefect_server import prefect_server_process

    shared_cuda_torch_env()  # made once (minutes), outside every timed build
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-causal-") as tmp:
        (Path(tmp) / "prefect-home").mkdir()
        with prefect_server_process(Path(tmp) / "prefect-home") as server:
            for n in range(args.repeats):
                _repeat(Path(tmp), {**server.env, "KILN_DAEMON": "off"}, n, times)
    cold = statistics.median(times["cold"])
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cpus, Python {platform.python_version()}, "
          f"at {time.strftime('%Y-%m-%d %H:%M')}")
    for arm in ARMS:
        median = statistics.median(times[arm])
        print(f"{arm}: median {median:.1f} s of {[round(t, 1) for t in times[arm]]}; ratio to cold {median / cold:.3f}")


if __name__ == "__main__":
    main()
