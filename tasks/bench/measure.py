"""Benchmark the *installed* package: the harness, run inside the variant's test environment.

``python -P -m kiln.tasks.bench.measure --config kiln.toml --size S --metric M --out F [--kernel K]``
imports the project's registry from the environment's installed wheel (never
from the source tree), measures the named kernel (or, without ``--kernel``,
lists the kernels), and writes JSON to ``F``: ``{"kernels": [...]}`` or
``{"cases": [...]}``, or ``{"error": type, "message": text, "retryable": bool}``.
The bench stage runs one such process per kernel, with a deadline.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

from kiln.release.errors import BenchmarkError, InfrastructureError, KilnError
from kiln.release.fsutil import atomic_write_text
from kiln.tasks.process import PopenChild, run_with_deadline
from kiln.tasks.bench.harness import bench_kernel, bench_specs, kernel_cases, prepare
from kiln.tasks.config import load_config


def _measure(ns: argparse.Namespace) -> dict:
    config = load_config(ns.config)
    if ns.kernel is None:  # kernels without cases are named: measuring one costs a process start
        setup = prepare(config, ns.size, ns.metric, installed=True)
        specs = bench_specs(config, installed=True)
        return {"kernels": [s.name for s in specs], "device": setup.plan.device,
                "empty": [s.name for s in specs if not kernel_cases(s, setup.size)]}
    setup = prepare(config, ns.size, ns.metric, installed=True, kernels=[ns.kernel])
    (spec,) = bench_specs(config, [ns.kernel], installed=True)
    cases = bench_kernel(spec, setup.size, setup.plan)
    return {"cases": [case.model_dump(mode="json") for case in cases]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.tasks.bench.measure")
    parser.add_argument("--config", required=True)
    parser.add_argument("--size", required=True)
    parser.add_argument("--metric", required=True)
    parser.add_argument("--kernel")
    parser.add_argument("--out", required=True)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        answer = _measure(ns)
    except KilnError as exc:
        answer = {"error": type(exc).__name__, "message": str(exc), "retryable": exc.retryable}
    atomic_write_text(ns.out, json.dumps(answer) + "\n")
    return 0 if "error" not in answer else 1



# --- the bench stage's side: one measuring process, held to a deadline ---------------


def run_measure(python: str, config_path: str, work: Path, *, size: str, metric: str, kernel: str | None,
                timeout_s: float) -> dict:
    """Run the harness in ``python``'s environment; its answer, or a typed error naming what went wrong."""
    work.mkdir(parents=True, exist_ok=True)
    out = work / f"{kernel or 'kernels'}.json"
    out.unlink(missing_ok=True)
    cmd = [python, "-P", "-m", "kiln.tasks.bench.measure", "--config", str(Path(config_path).resolve()),
           "--size", size, "--metric", metric, "--out", str(out), *(["--kernel", kernel] if kernel else [])]
    logging.getLogger("kiln.bench").info("running %s", " ".join(cmd))
    with open(work / f"{kernel or 'kernels'}.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=Path(config_path).resolve().parent, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ladder = run_with_deadline(PopenChild(proc), timeout_s, stack_path=None)
    what = f"benchmark of {kernel or 'the kernel list'}"
    if ladder.timed_out:
        raise BenchmarkError(f"{what} ran past {timeout_s:g}s; its process group was ended by {ladder.escalation}")
    if not out.exists():
        tail = (work / f"{kernel or 'kernels'}.log").read_text(errors="replace")[-2000:]
        raise InfrastructureError(f"{what} exited {ladder.returncode} without an answer:\n{tail}")
    answer = json.loads(out.read_text())
    if "error" in answer:
        error = InfrastructureError if answer.get("retryable") else BenchmarkError
        raise error(f"{what}: {answer['error']}: {answer['message']}")
    return answer


if __name__ == "__main__":
    sys.exit(main())
