"""What recording what each test touched costs: the same suite through the fork server, recording off and on.

    python benchmarks/bench_touch.py [--tests 60] [--repeats 5] [--no-preload] [--json out.json]

A suite of ``--tests`` tests that import nothing (the worst case: recording's fixed cost per test is all there
is), against a tiny installed wheel, run by :func:`kiln.tasks.testing.runner.run_tests` with ``isolate="test"``
and the real preload (torch, Triton: the ``sys.modules`` every recorded test walks at its end). Each repeat runs
both modes, alternating which goes first; medians are reported, and the cost per test is
(median on − median off) / tests, in wall time and in CPU time (the worker and its forks, from
``RUSAGE_CHILDREN``: steadier than wall on a shared machine). Recording is switched off by not naming the tested
distribution.

Also timed in this process (torch imported, as in the worker): one :meth:`Recorder.finish`, median of 50.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kiln.core.venvs import uv_command  # noqa: E402
from kiln.tasks.testing.jobs import PRELOAD, RunOptions  # noqa: E402
from kiln.tasks.testing.runner import run_tests  # noqa: E402
from kiln.tasks.testing.touch import TESTED_ENV, make_recorder  # noqa: E402
from tests.helpers.wheelkit import make_wheel  # noqa: E402


def _project(tmp: Path, tests: int) -> tuple[Path, Path]:
    root = tmp / "project"
    (root / "tests_b").mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\n")
    body = "import benchpkg\n\n" + "".join(f"\ndef test_{n}():\n    assert benchpkg.PAYLOAD == ''\n"
                                          for n in range(tests))
    (root / "tests_b" / "test_bench.py").write_text(body)
    site = root / "_site"  # the tests' sandbox reads the project: the installed wheel must lie there
    subprocess.run([*uv_command(), "pip", "install", "--quiet", "--no-deps", "--offline", "--python", sys.executable,
                    "--target", str(site), str(make_wheel(tmp / "dist", "benchpkg", "1.0"))],
                   check=True, timeout=120, capture_output=True)
    return root, site


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the worker and its forks, once each is reaped
    return usage.ru_utime + usage.ru_stime


def _suite(root: Path, site: Path, work: Path, record: bool, preload: tuple[str, ...]) -> tuple[float, float, int]:
    env = {"PYTHONPATH": str(site), **({TESTED_ENV: "benchpkg"} if record else {})}
    start, cpu = time.perf_counter(), _cpu()
    results = run_tests(["tests_b"], root, work, RunOptions(preload=preload, env=env, gpus=0, retries=0))
    wall, cpu = time.perf_counter() - start, _cpu() - cpu
    bad = [r for r in results if r.outcome != "passed"]
    if bad or record != all(r.touched for r in results):
        raise SystemExit(f"unexpected results (record={record}): {bad[:2] or results[:1]}")
    return wall, cpu, len(results)


def _finish_cost(root: Path, site: Path) -> float:
    """Median seconds of one Recorder.finish in this process, with torch imported."""
    import torch  # noqa: F401  the worker's sys.modules, roughly

    sys.path.insert(0, str(site))
    os.environ[TESTED_ENV] = "benchpkg"
    recorder = make_recorder(root, [root / "tests_b" / "test_bench.py"])
    assert recorder is not None
    recorder.install()
    times = []
    for _ in range(50):
        recorder.begin()
        start = time.perf_counter()
        recorder.finish(root / "tests_b" / "test_bench.py")
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tests", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-preload", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    preload = () if args.no_preload else PRELOAD
    walls: dict[bool, list[float]] = {False: [], True: []}
    cpus: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-touch-") as tmp:
        root, site = _project(Path(tmp), args.tests)
        for repeat in range(args.repeats):
            for record in ((False, True) if repeat % 2 == 0 else (True, False)):
                wall, cpu, count = _suite(root, site, Path(tmp) / f"work-{repeat}-{record}", record, preload)
                walls[record].append(wall)
                cpus[record].append(cpu)
                print(f"repeat {repeat}: recording {'on ' if record else 'off'} {wall:.2f} s wall, {cpu:.2f} s CPU"
                      f" ({count} tests)")
        finish = _finish_cost(root, site)
    off, on = statistics.median(walls[False]), statistics.median(walls[True])
    cpu_off, cpu_on = statistics.median(cpus[False]), statistics.median(cpus[True])
    result = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}",
        "tests": args.tests, "preload": list(preload), "repeats": args.repeats,
        "off_s": walls[False], "on_s": walls[True], "median_off_s": off, "median_on_s": on,
        "ratio": on / off, "per_test_ms": (on - off) / args.tests * 1000, "finish_ms": finish * 1000,
        "cpu_off_s": cpus[False], "cpu_on_s": cpus[True], "cpu_ratio": cpu_on / cpu_off,
        "cpu_per_test_ms": (cpu_on - cpu_off) / args.tests * 1000,
    }
    print(f"median wall off {off:.2f} s, on {on:.2f} s: ×{on / off:.3f}, {result['per_test_ms']:.1f} ms per test")
    print(f"median CPU off {cpu_off:.2f} s, on {cpu_on:.2f} s: ×{cpu_on / cpu_off:.3f}, "
          f"{result['cpu_per_test_ms']:.1f} ms per test; one finish() in-process {finish * 1000:.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
