"""Benchmark the *installed* package: the harness, run inside the variant's test environment.

``python -P -m kiln.tasks.bench.measure --config kiln.toml --size S --metric M --out F [--kernel K]``
imports the project's registry from the environment's installed wheel (never
from the source tree), measures the named kernel (or, without ``--kernel``,
lists the kernels), and writes JSON to ``F``: ``{"kernels": [...]}`` or
``{"cases": [...]}``, or ``{"error": type, "message": text, "retryable": bool}``.
The bench stage runs one such process per kernel, with a deadline: forked
from one ``measure serve`` process that imported everything once
(:mod:`kiln.tasks.bench.forking`), or a fresh interpreter where forking is refused.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kiln.core.errors import BenchmarkError, InfrastructureError, KilnError
from kiln.core.fsutil import atomic_write_text
from kiln.core.sandbox import guest_command, guest_environ
from kiln.tasks.bench.forking import MeasureServer, serve
from kiln.tasks.bench.harness import bench_kernel, bench_specs, kernel_cases, prepare
from kiln.tasks.process import Child, PopenChild, run_with_deadline, single_threaded
from kiln.tasks.project.config import load_config

_log = logging.getLogger(__name__)


def _measure(ns: argparse.Namespace) -> dict[str, Any]:
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


def _answer(config: str, size: str, metric: str, kernel: str | None, out: str) -> int:
    """Measure (or list), write the answer to ``out``; 0 unless the answer is an error."""
    ns = argparse.Namespace(config=config, size=size, metric=metric, kernel=kernel)
    try:
        answer = _measure(ns)
    except KilnError as exc:
        answer = {"error": type(exc).__name__, "message": str(exc), "retryable": exc.retryable}
    atomic_write_text(out, json.dumps(answer) + "\n")
    return 0 if "error" not in answer else 1


def _serve(ns: argparse.Namespace) -> int:
    """``serve``: import once, then fork a measuring child per request (kiln.tasks.bench.forking)."""
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # what the imports print goes to the log, never into the replies
    threads = None
    try:  # imports only (never a device query, which would poison forks): a failure is each child's own answer
        import torch  # noqa: F401

        threads = single_threaded()
        bench_specs(load_config(ns.config), installed=True)
    except Exception as exc:
        _log.warning("measuring server warm-up failed: %s", exc)
    return serve(sys.stdin, replies, lambda kernel, out: _answer(ns.config, ns.size, ns.metric, kernel, out),
                 threads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.tasks.bench.measure")
    parser.add_argument("mode", nargs="?", choices=["serve"], help="serve: fork a child per request on stdin")
    parser.add_argument("--config", required=True)
    parser.add_argument("--size", required=True)
    parser.add_argument("--metric", required=True)
    parser.add_argument("--kernel")
    parser.add_argument("--out")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if ns.mode == "serve":
        return _serve(ns)
    if not ns.out:
        parser.error("--out is required")
    return _answer(ns.config, ns.size, ns.metric, ns.kernel, ns.out)



# --- the bench stage's side: one measuring process, held to a deadline ---------------


def _command(python: str, config_path: str, size: str, metric: str, *mode: str) -> list[str]:
    return [python, "-P", "-m", "kiln.tasks.bench.measure", *mode, "--config", str(Path(config_path).resolve()),
            "--size", size, "--metric", metric]


def measure_server(python: str, config_path: str, work: Path, *, size: str, metric: str) -> MeasureServer:
    """A forking server for ``python``'s environment: one interpreter start for every kernel of the stage."""
    return MeasureServer(_command(python, config_path, size, metric, "serve"), Path(config_path).resolve().parent,
                         work / "server.log")


def _spawn(cmd: list[str], cwd: Path, log_path: Path) -> PopenChild:
    _log.info("running %s", " ".join(cmd))
    with open(log_path, "wb") as log:
        return PopenChild(subprocess.Popen(guest_command(cmd, read=[cwd], write=[log_path.parent], network="loopback"),
                                           cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True, env=guest_environ(log_path.parent / "home")))


def run_measure(python: str, config_path: str, work: Path, *, size: str, metric: str, kernel: str | None,
                timeout_s: float, server: MeasureServer | None = None) -> dict[str, Any]:
    """Run the harness in ``python``'s environment; its answer, or a typed error naming what went wrong.

    With ``server`` the measuring process is forked from it; else (or when it
    refuses) it is a fresh interpreter.
    """
    work.mkdir(parents=True, exist_ok=True)
    out, log = work / f"{kernel or 'kernels'}.json", work / f"{kernel or 'kernels'}.log"
    out.unlink(missing_ok=True)
    forked = server.fork(kernel, out, log) if server is not None else None
    child: Child
    if forked is not None:
        child = forked
    else:
        extra = ["--out", str(out), *(["--kernel", kernel] if kernel else [])]
        child = _spawn(_command(python, config_path, size, metric) + extra, Path(config_path).resolve().parent, log)
    ladder = run_with_deadline(child, timeout_s, stack_path=None)
    what = f"benchmark of {kernel or 'the kernel list'}"
    if ladder.timed_out:
        raise BenchmarkError(f"{what} ran past {timeout_s:g}s; its process group was ended by {ladder.escalation}")
    if not out.exists():
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise InfrastructureError(f"{what} exited {ladder.returncode} without an answer:\n{tail}")
    answer: dict[str, Any] = json.loads(out.read_text())
    if "error" in answer:
        error = InfrastructureError if answer.get("retryable") else BenchmarkError
        raise error(f"{what}: {answer['error']}: {answer['message']}")
    return answer


if __name__ == "__main__":
    sys.exit(main())
