"""The isolation runner: every test (or test file) in its own process, with a deadline.

A worker (``kiln.tasks.testing.pytest_server``) is started as a fresh interpreter — so no
GPU state is ever inherited — imports torch and triton, collects the suite
once and then forks one child per job (``start="forkserver"``); or each job
is a fresh interpreter of its own (``start="spawn"``). Either way the child
leads its own process group and this module holds it to its deadline with
the ladder of :mod:`kiln.tasks.process`, pins its GPUs, classifies how it ended,
and retries only infrastructure failures, up to ``retries`` times.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path

from kiln.tasks.process import LadderResult, check_cancelled, signal_name, terminate, watch
from kiln.tasks.testing.classify import TestResult, classify_phases, classify_unfinished, merge_attempts, should_retry
from kiln.tasks.testing.devices import DevicePool, detect_gpu_count, pin_env, skip_reason
from kiln.tasks.testing.jobs import Isolation, Item, Job, Picker, RunOptions
from kiln.tasks.testing.workers import (
    ForkedChild,
    Progress,
    SpawnedChild,
    Worker,
    read_records,
    remove_scratch,
    spawn_job,
)

logger = logging.getLogger(__name__)


def job_results(job: Job, results: Path, stacks: Path, ladder: LadderResult, lost: bool,
                timeout_s: float) -> tuple[list[TestResult], set[str]]:
    """A result for every item that began, and the set of those that began."""
    began, finished = read_records(results)
    crash_dump = stacks.read_text(errors="replace") if stacks.exists() else ""
    out = []
    for item in job.items:
        if item.nodeid in finished:
            out.append(classify_phases(item.nodeid, finished[item.nodeid]))
        elif item.nodeid in began:
            out.append(classify_unfinished(
                item.nodeid, began=True, returncode=ladder.returncode, timed_out=ladder.timed_out,
                signal=signal_name(ladder.returncode), stacks=ladder.stacks or crash_dump, lost=lost,
                duration_s=ladder.elapsed_s, timeout_s=timeout_s, escalation=ladder.escalation,
            ))
    if ladder.timed_out:
        logger.warning("job %s timed out; process group ended by %s", job.id, ladder.escalation)
    return out, set(began)


class Runner:
    """Runs the jobs of one collected suite, several at once within the device budget."""

    def __init__(self, root: Path, work: Path, options: RunOptions, worker: Worker | None, devices: int) -> None:
        self.root, self.work, self.options, self.worker = root, work, options, worker
        self.devices = DevicePool(devices)
        self._seq = 0
        self._seq_lock = threading.Lock()

    def execute(self, job: Job, devices: tuple[int, ...]) -> list[TestResult]:
        """Run ``job``; when its process dies mid-way, the tests it never began get a new one."""
        out: list[TestResult] = []
        remaining = job.items
        for round_ in range(len(job.items)):
            part = Job(f"{job.id}.{round_}", remaining)
            results, began, ladder, log = self._execute_once(part, devices)
            out.extend(results)
            if not began:  # it died before any test: another process would too
                out.extend(classify_unfinished(i.nodeid, began=False, returncode=ladder.returncode,
                                               timed_out=ladder.timed_out, signal=None, stacks=log, lost=False)
                           for i in remaining)
                break
            remaining = tuple(i for i in remaining if i.nodeid not in began)
            if not remaining:
                break
        return out

    def _execute_once(self, job: Job, devices: tuple[int, ...]) -> tuple[list[TestResult], set[str], LadderResult, str]:
        check_cancelled(f"test job {job.id}")  # a job ended by a cancellation is not run again
        with self._seq_lock:
            self._seq += 1
            stem = self.work / f"job-{self._seq:05d}"
        results, stacks = stem.with_suffix(".jsonl"), stem.with_suffix(".stacks")
        env = pin_env(devices)
        child: ForkedChild | SpawnedChild | None = None
        if self.worker is not None and self.options.start == "forkserver":
            child = self.worker.launch(job, env, results, stacks)
        if child is None:
            child = spawn_job(job, self.root, env, results, stacks, self.options)
        progress = Progress(results, self.options.timeout_s, self.options.startup_timeout_s)
        ladder = watch(child, progress.deadline, self.options.grace_s, stacks)
        tests, began = job_results(job, results, stacks, ladder, child.lost, self.options.timeout_s)
        log = results.with_suffix(".log")
        return tests, began, ladder, log.read_text(errors="replace")[-4000:] if log.exists() else ""

    def run_jobs(self, jobs: Sequence[Job]) -> list[TestResult]:
        results: list[TestResult] = []
        pending = list(jobs)
        cpu_running = 0
        running: dict[Future[list[TestResult]], tuple[Job, tuple[int, ...]]] = {}
        with ThreadPoolExecutor(max_workers=self.options.parallel + self.devices.count) as pool:
            while pending or running:
                if pending:
                    check_cancelled(f"{len(pending)} test job(s)")
                for job in list(pending):
                    if job.gpus == 0 and cpu_running >= self.options.parallel:
                        continue
                    devices = self.devices.acquire(job.gpus)
                    if devices is None:
                        continue
                    pending.remove(job)
                    cpu_running += job.gpus == 0
                    running[pool.submit(self.execute, job, devices)] = (job, devices)
                done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for future in done:
                    job, devices = running.pop(future)
                    self.devices.release(devices)
                    cpu_running -= job.gpus == 0
                    results.extend(future.result())
        return results


def device_env(devices: int) -> dict[str, str]:
    """Environment of the worker and every job, decided before anything imports torch or triton.

    NVML answers ``torch.cuda.is_available()`` in the worker without
    initialising CUDA, so forking stays safe after a conftest asks. With no
    GPU to use, no process sees one, and Triton must be in interpreter mode
    before it is first imported: the worker preloads it, and Triton fixes
    the mode of its standard library at import.
    """
    env = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    if devices == 0:
        env.update(pin_env(()))
        env["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET", "1")
    return env


def make_jobs(items: Sequence[Item], isolate: Isolation, prefix: str = "j") -> list[Job]:
    if isolate == "test":
        return [Job(f"{prefix}{i.index}", (i,)) for i in items]
    by_file: dict[str, list[Item]] = {}
    for item in items:
        by_file.setdefault(item.file, []).append(item)
    return [Job(f"{prefix}{n}", tuple(group)) for n, group in enumerate(by_file.values())]


def _run_with_retries(runner: Runner, items: list[Item], options: RunOptions) -> list[TestResult]:
    attempts: dict[str, list[TestResult]] = {i.nodeid: [] for i in items}
    todo, isolate = items, options.isolate
    for attempt in range(options.retries + 1):
        for result in runner.run_jobs(make_jobs(todo, isolate, prefix=f"a{attempt}-")):
            attempts[result.nodeid].append(result)
        todo = [i for i in todo if should_retry(attempts[i.nodeid][-1])]
        if not todo:
            break
        logger.info("retrying %d test(s) after infrastructure failures: %s", len(todo), [i.nodeid for i in todo])
        isolate = "test"  # a retry runs each test alone
    return [merge_attempts(attempts[i.nodeid]) for i in items]


def run_tests(
    paths: Sequence[str], root: str | Path, work_dir: str | Path, options: RunOptions = RunOptions()
) -> list[TestResult]:
    """Collect ``paths`` (relative to ``root``) and run each test in isolation; one result per test."""
    root, work = Path(root).resolve(), Path(work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    devices = detect_gpu_count() if options.gpus is None else options.gpus
    options = replace(options, env={**device_env(devices), **options.env})
    worker = Worker(paths, root, work, options)
    try:
        collected = worker.collect()
        if collected is None:
            return [_collection_failure(worker)]
        items = [Item(n, i["nodeid"], i["file"], int(i["gpus"])) for n, i in enumerate(collected["items"])]
        errors = [TestResult(e["nodeid"], "error", message="collection failed", details=e["longrepr"])
                  for e in collected["errors"]]
        settled: dict[str, TestResult] = {}
        if options.pick is not None:
            items, settled = _picked(items, options.pick)
            if errors:  # a file that no longer collects may hide a change the picker cannot see: carry nothing
                settled = {}
        runner = Runner(root, work, options, worker, devices)
        by_id: dict[str, TestResult] = dict(settled)
        runnable = []
        for item in items:
            if item.nodeid in settled:
                continue
            reason = skip_reason(item.gpus, runner.devices.count)
            if reason:
                by_id[item.nodeid] = TestResult(item.nodeid, "skipped", message=reason)
            else:
                runnable.append(item)
        by_id.update({r.nodeid: r for r in _run_with_retries(runner, runnable, options)})
        return errors + [by_id[i.nodeid] for i in items]
    finally:
        worker.close()
        remove_scratch(work)


def _picked(items: list[Item], pick: Picker) -> tuple[list[Item], dict[str, TestResult]]:
    """The collected items this run reports, in collection order: those ``pick`` runs and those it settled
    without running; the rest belong to another unit."""
    picked = pick([item.nodeid for item in items])
    settled = {r.nodeid: r for r in picked.settled}
    keep = set(picked.run) | set(settled)
    return [item for item in items if item.nodeid in keep], settled


def _collection_failure(worker: Worker) -> TestResult:
    """The worker ended or hung before it collected: say why, with its stacks and log."""
    code = worker.proc.poll()
    stacks = ""
    if code is None:
        code = terminate(SpawnedChild(worker.proc), worker.options.grace_s).returncode
        stacks = "collection did not finish in time\n"
    return TestResult("<collection>", "error", 0.0, f"the test worker could not collect the suite (exit {code})",
                      stacks + worker.log_tail())
