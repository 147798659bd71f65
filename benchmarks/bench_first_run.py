"""Fresh clone → nightly done: the README's first command, verbatim, at two commits, A/B.

For each arm a fresh ``git clone`` of this repository at the arm's commit runs the first command of *that
commit's* README (a ``python3 -m venv … kiln nightly`` line) the way CI's first-run check does
(``.ci/first_run.py``: its own HOME, TMPDIR and Prefect home; only pip's and uv's download caches shared).
Reported per arm: the wall time from the command's start to its last line, the install (everything before
the nightly's first Prefect line: pip, then Kiln's server start) and each stage, read from Prefect's own
``Beginning``/``Finished`` lines; the median of ``--runs``, the arms alternating (ABAB...) so that a
machine's drift and pip's HTTP cache age fall on both. The ratio is new / baseline. Usage::

    python3 benchmarks/bench_first_run.py --baseline 7c061f4 [--new HEAD] [--runs 2]

Standard library only, like ``.ci/first_run.py``: it runs before any environment exists.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def _first_run_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("first_run", REPO / ".ci" / "first_run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_run(fr: ModuleType, commit: str, timeout: float, keep: Path | None = None) -> dict[str, float]:
    """One fresh clone at ``commit`` and its README's first command; its times in seconds (``keep``: where its
    output goes, each line with the seconds since the command started)."""
    root = Path(tempfile.mkdtemp(prefix="kiln-bench-first-run-"))
    clone = root / "kiln"
    env: dict[str, str] = {}
    try:
        subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)], check=True, timeout=300)
        subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", commit], check=True, timeout=60)
        env = fr.fresh_environment(root)
        command = fr.first_command(clone / "README.md")
        status, _, lines = fr.run_logged(["bash", "-c", command], clone, env, timeout, root / "first-run.log")
        if status != 0:
            raise SystemExit(f"bench_first_run: {commit}: the first command exited {status}; see {root}")
        if keep is not None:
            keep.write_text("".join(f"{t:7.1f} {text}\n" for t, text in lines), encoding="utf-8")
        times = {"fresh clone -> nightly done": lines[-1][0]}
        for what, seconds in fr.stage_times(lines).items():
            times[what.split(" (")[0]] = seconds
        return times
    finally:
        if env:
            fr.stop_services(clone, env)
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the commit to compare against")
    parser.add_argument("--new", default="HEAD")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--logs", type=Path, help="keep each run's timed output in this folder")
    args = parser.parse_args(argv)
    fr = _first_run_module()
    arms = {name: subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], check=True, text=True,
                                 capture_output=True).stdout.strip()
            for name, rev in (("baseline", args.baseline), ("new", args.new))}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
    for run in range(args.runs):
        for name, commit in arms.items():
            keep = None
            if args.logs is not None:
                args.logs.mkdir(parents=True, exist_ok=True)
                keep = args.logs / f"{name}-{commit}-{run + 1}.log"
            times = one_run(fr, commit, args.timeout, keep)
            results[name].append(times)
            print(f"run {run + 1} {name} {commit}: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()),
                  flush=True)
    keys = list(dict.fromkeys(k for runs in results.values() for times in runs for k in times))
    print(f"\n| median of {args.runs} | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    medians = {name: {k: statistics.median(t[k] for t in runs if k in t) for k in keys
                      if any(k in t for t in runs)} for name, runs in results.items()}
    for name, commit in arms.items():
        print(f"| {name} `{commit}` | " + " | ".join(f"{medians[name].get(k, float('nan')):.0f} s" for k in keys)
              + " |")
    total = "fresh clone -> nightly done"
    print(f"\nratio new/baseline ({total}): {medians['new'][total] / medians['baseline'][total]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
