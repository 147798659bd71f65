"""The isolation runner: every test (or test file) in its own process, with a deadline.

A worker (``tasks.isolate_worker``) is started as a fresh interpreter — so no
GPU state is ever inherited — imports torch and triton, collects the suite
once and then forks one child per job (``start="forkserver"``); or each job
is a fresh interpreter of its own (``start="spawn"``). Either way the child
leads its own process group and this module holds it to its deadline with
the ladder of :mod:`tasks.deadline`, pins its GPUs, classifies how it ended,
and retries only infrastructure failures, up to ``retries`` times.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from release.errors import InvalidInputError
from tasks.classify import TestResult, classify_phases, classify_unfinished, merge_attempts, should_retry
from tasks.deadline import LadderResult, run_with_deadline, signal_name, terminate, watch
from tasks.devices import DevicePool, detect_gpu_count, pin_env, skip_reason

logger = logging.getLogger("kiln.test.isolate")

Isolation = Literal["test", "file"]
StartMethod = Literal["forkserver", "spawn"]
KILN_ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 30.0  # a fork answers in milliseconds; this only bounds a wedged server


@dataclass(frozen=True)
class RunOptions:
    isolate: Isolation = "test"
    start: StartMethod = "forkserver"
    timeout_s: float = 300.0          # per test
    grace_s: float = 2.0
    retries: int = 1                  # extra attempts for infrastructure failures only
    markers: str = ""
    pytest_args: tuple[str, ...] = ()
    gpus: int | None = None           # devices this run may use; None: detect
    parallel: int = 1                 # CPU-only jobs at once
    env: Mapping[str, str] = field(default_factory=dict)
    preload: tuple[str, ...] = ("torch", "triton")
    collect_timeout_s: float = 600.0
    startup_timeout_s: float = 120.0  # a spawned job's interpreter start and collection

    def __post_init__(self) -> None:
        if self.isolate not in ("test", "file"):
            raise InvalidInputError(f"isolate={self.isolate!r}: use 'test' or 'file'")
        if self.start not in ("forkserver", "spawn"):
            raise InvalidInputError(f"start={self.start!r}: use 'forkserver' or 'spawn'")
        if not self.timeout_s > 0 or self.grace_s < 0:
            raise InvalidInputError(f"timeout={self.timeout_s!r} must be > 0 and grace={self.grace_s!r} >= 0")
        if not 0 <= self.retries <= 10:
            raise InvalidInputError(f"retries={self.retries!r} must be between 0 and 10")
        if self.parallel < 1:
            raise InvalidInputError(f"parallel={self.parallel!r} must be at least 1")


@dataclass(frozen=True)
class Item:
    index: int
    nodeid: str
    file: str
    gpus: int


@dataclass(frozen=True)
class Job:
    id: str
    items: tuple[Item, ...]

    @property
    def gpus(self) -> int:
        return max(item.gpus for item in self.items)


def process_env(root: Path, extra: Mapping[str, str]) -> dict[str, str]:
    """The test processes' environment: the project root and Kiln importable, plus ``extra``."""
    env = dict(os.environ)
    paths = [str(root), str(KILN_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.update(extra)
    return env


class SpawnedChild:
    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc, self.pid, self.lost = proc, proc.pid, False

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None


class ForkedChild:
    """A child of the worker: the worker reaps it and reports its status to us."""

    def __init__(self, pid: int, exits: queue.Queue[int | None]) -> None:
        self.pid, self.lost, self._exits, self._code = pid, False, exits, None

    def wait(self, timeout: float) -> int | None:
        if self._code is None and not self.lost:
            try:
                code = self._exits.get(timeout=max(timeout, 0.0))
            except queue.Empty:
                return None
            self.lost = code is None
            self._code = code
        return -9 if self.lost else self._code


class Worker:
    """The pytest session that collects once and forks jobs (see tasks.isolate_worker)."""

    def __init__(self, paths: Sequence[str], root: Path, work: Path, options: RunOptions) -> None:
        self.options, self.work = options, work
        cmd_r, self._cmd_w = os.pipe()
        evt_r, evt_w = os.pipe()
        args = [sys.executable, "-m", "tasks.isolate_worker", "serve", "--commands-fd", str(cmd_r),
                "--events-fd", str(evt_w), *sum((["--preload", m] for m in options.preload), []),
                "--", *pytest_argv(paths, options)]
        logger.info("starting the test worker: %s", " ".join(args))
        self.log = work / "worker.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(args, cwd=root, env=process_env(root, options.env), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, pass_fds=(cmd_r, evt_w),
                                         start_new_session=True)
        os.close(cmd_r)
        os.close(evt_w)
        self._events = os.fdopen(evt_r, "r", encoding="utf-8")
        self._queues: dict[str, queue.Queue[Any]] = {"collected": queue.Queue()}
        self._lock = threading.Lock()
        self._lost = False
        threading.Thread(target=self._read, name="kiln-worker-events", daemon=True).start()

    def _queue(self, key: str) -> queue.Queue[Any]:
        with self._lock:
            if key not in self._queues:
                self._queues[key] = queue.Queue()
                if self._lost:
                    self._queues[key].put(None)
            return self._queues[key]

    def _read(self) -> None:
        for line in self._events:
            event = json.loads(line)
            kind = event["event"]
            key = "collected" if kind == "collected" else f"{event['job']}:{'exit' if kind == 'exited' else 'start'}"
            self._queue(key).put(event)
        with self._lock:  # EOF: the worker is gone; wake everyone who waits on it
            self._lost = True
            for q in self._queues.values():
                q.put(None)

    def collect(self) -> dict[str, Any] | None:
        """The collected items and collection errors, or None if the worker died or hung."""
        try:
            return self._queue("collected").get(timeout=self.options.collect_timeout_s)
        except queue.Empty:
            return None

    def launch(self, job: Job, env: Mapping[str, str], results: Path, stacks: Path) -> ForkedChild | None:
        """Fork ``job``; None when the worker refused (GPU initialised) or is lost."""
        exits: queue.Queue[int | None] = queue.Queue()
        started = self._queue(f"{job.id}:start")
        command = {"cmd": "run", "job": job.id, "items": [i.index for i in job.items], "env": dict(env),
                   "results": str(results), "stacks": str(stacks)}
        with self._lock:
            if self._lost:
                return None
            os.write(self._cmd_w, (json.dumps(command) + "\n").encode())
        try:
            event = started.get(timeout=START_TIMEOUT_S)
        except queue.Empty:
            return None
        if event is None or event["event"] == "refused":
            logger.warning("worker did not fork job %s: %s", job.id, (event or {}).get("reason", "worker lost"))
            return None
        threading.Thread(target=self._forward_exit, args=(job.id, exits), daemon=True).start()
        return ForkedChild(event["pid"], exits)

    def _forward_exit(self, job_id: str, exits: queue.Queue[int | None]) -> None:
        event = self._queue(f"{job_id}:exit").get()
        exits.put(None if event is None else int(event["returncode"]))

    def close(self) -> LadderResult:
        try:
            os.write(self._cmd_w, b'{"cmd": "exit"}\n')
        except OSError:
            pass  # already gone
        os.close(self._cmd_w)
        return run_with_deadline(SpawnedChild(self.proc), 30.0, self.options.grace_s)

    def log_tail(self, limit: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-limit:] if self.log.exists() else ""


def pytest_argv(paths: Sequence[str], options: RunOptions) -> list[str]:
    # pytest-timeout would race our own deadline; the cache is shared by every worker.
    argv = ["-p", "no:cacheprovider", "-p", "no:timeout", "-q", *paths]
    if options.markers:
        argv += ["-m", options.markers]
    return argv + list(options.pytest_args)


def spawn_job(job: Job, root: Path, env: Mapping[str, str], results: Path, stacks: Path,
              options: RunOptions) -> SpawnedChild:
    args = [sys.executable, "-m", "tasks.isolate_worker", "run", "--results", str(results), "--stacks", str(stacks),
            "--", *pytest_argv([i.nodeid for i in job.items], replace(options, markers=""))]
    logger.info("spawning %s", " ".join(args))
    log = open(results.with_suffix(".log"), "wb")  # noqa: SIM115 — handed to the child, closed below
    try:
        proc = subprocess.Popen(args, cwd=root, env=process_env(root, {**options.env, **env}),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()
    return SpawnedChild(proc)


def read_records(path: Path) -> tuple[list[str], dict[str, list[dict[str, Any]]]]:
    """(nodeids begun, phases per finished nodeid) from a job's results file."""
    began, finished = [], {}
    if path.exists():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # the child died mid-line
            if "begin" in record:
                began.append(record["begin"])
            elif "result" in record:
                finished[record["result"]] = record["phases"]
    return began, finished


class Progress:
    """Follows a job's results file so each test's deadline starts when that test begins
    (a fresh interpreter's start-up and collection are not the test's time)."""

    def __init__(self, path: Path, timeout_s: float, startup_s: float) -> None:
        self.path, self.timeout_s, self.startup_s = path, timeout_s, startup_s
        self._offset, self._partial = 0, b""
        self.current: str | None = None
        self.since = time.monotonic()

    def deadline(self) -> float:
        self._poll()
        return self.since + (self.timeout_s if self.current else self.startup_s)

    def _poll(self) -> None:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            record = json.loads(line)
            self.current = record.get("begin")
            self.since = time.monotonic()


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

    def __init__(self, root: Path, work: Path, options: RunOptions, worker: Worker | None) -> None:
        self.root, self.work, self.options, self.worker = root, work, options, worker
        self.devices = DevicePool(detect_gpu_count() if options.gpus is None else options.gpus)
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


def run_tests(paths: Sequence[str], root: str | Path, work_dir: str | Path, options: RunOptions = RunOptions()) -> list[TestResult]:
    """Collect ``paths`` (relative to ``root``) and run each test in isolation; one result per test."""
    root, work = Path(root).resolve(), Path(work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    worker = Worker(paths, root, work, options)
    try:
        collected = worker.collect()
        if collected is None:
            return [_collection_failure(worker)]
        items = [Item(n, i["nodeid"], i["file"], int(i["gpus"])) for n, i in enumerate(collected["items"])]
        errors = [TestResult(e["nodeid"], "error", message="collection failed", details=e["longrepr"])
                  for e in collected["errors"]]
        runner = Runner(root, work, options, worker)
        by_id: dict[str, TestResult] = {}
        runnable = []
        for item in items:
            reason = skip_reason(item.gpus, runner.devices.count)
            if reason:
                by_id[item.nodeid] = TestResult(item.nodeid, "skipped", message=reason)
            else:
                runnable.append(item)
        by_id.update({r.nodeid: r for r in _run_with_retries(runner, runnable, options)})
        return errors + [by_id[i.nodeid] for i in items]
    finally:
        worker.close()


def _collection_failure(worker: Worker) -> TestResult:
    """The worker ended or hung before it collected: say why, with its stacks and log."""
    code = worker.proc.poll()
    stacks = ""
    if code is None:
        code = terminate(SpawnedChild(worker.proc), worker.options.grace_s).returncode
        stacks = "collection did not finish in time\n"
    return TestResult("<collection>", "error", 0.0, f"the test worker could not collect the suite (exit {code})",
                      stacks + worker.log_tail())
