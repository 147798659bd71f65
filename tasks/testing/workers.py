"""The processes of the isolation runner: the forking worker, spawned jobs, their results.

:class:`Worker` drives ``kiln.tasks.testing.pytest_server serve`` over two pipes (JSON
lines): it collects once, then forks a child per job; the worker reaps the
child and reports its status, and :class:`ForkedChild` turns that into the
``wait`` of kiln.tasks.process's Child protocol. :func:`spawn_job` starts a job
as a fresh interpreter instead. A job appends ``begin``/``result`` lines to
its results file; :class:`Progress` follows it so each test's deadline starts
when that test begins.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kiln.core.sandbox import guest_command, guest_environ
from kiln.core.venvs import safe_path_flag
from kiln.tasks.process import (
    LadderResult,
    Mailboxes,
    PopenChild,
    cancel_requested,
    register,
    run_with_deadline,
    terminate,
    unregister,
)
from kiln.tasks.testing.jobs import Job, RunOptions

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0  # a fork answers in milliseconds; this only bounds a wedged server
# -P: ``python -m`` must not put the working directory (the project root) on
# sys.path; what the tests import is decided by the environment, not the checkout.
WORKER = ("-P", "-m", "kiln.tasks.testing.pytest_server")


def worker_args(python: str) -> tuple[str, ...]:
    """:data:`WORKER` for ``python``: a Python 3.10 cell's environment gets ``-I`` (it has no ``-P``)."""
    return (safe_path_flag(python), *WORKER[1:])


def scratch_home(work: Path) -> Path:
    """The tests' private ``HOME`` and ``TMPDIR`` parent for the run in ``work``: a short path in the system's
    temporary folder (a socket a test binds there must fit ``AF_UNIX``'s 108 bytes; ``work`` may be deep),
    owner-only, removed with the run (:func:`remove_scratch`)."""
    home = Path(tempfile.gettempdir()) / f"kiln-t-{hashlib.sha256(str(work).encode()).hexdigest()[:12]}"
    home.mkdir(mode=0o700, exist_ok=True)
    return home


def remove_scratch(work: Path) -> None:
    shutil.rmtree(scratch_home(work), ignore_errors=True)


def process_env(work: Path, extra: Mapping[str, str], pass_env: Sequence[str] = ()) -> dict[str, str]:
    """The test processes' environment (they run the package's code): the allow-listed part of this one, plus
    ``extra`` and the suite's ``pass_env`` names, a private home (Kiln adds no path of its own)."""
    return guest_environ(scratch_home(work), extra, pass_env)


def sandboxed(cmd: Sequence[str], root: Path, work: Path, paths: Sequence[str]) -> list[str]:
    """``cmd`` in the tests' sandbox: read the interpreter's environment (the layers under it read-only), Kiln's
    runner code and the tests under ``root``; write only ``work`` (results, stacks, the private home), the
    suite's own environment (never Kiln's) and the test folders ``paths`` name (a suite writes beside its tests:
    snapshots, markers), never the rest of the project, where a ``file://`` store may live; loopback only."""
    env_root = Path(cmd[0]).parent.parent
    own = [env_root] if (env_root / "pyvenv.cfg").is_file() and env_root.resolve() != Path(sys.prefix).resolve() else []
    tops = {Path(p.split("::", 1)[0]).parts[0] for p in paths if p and not os.path.isabs(p)} - {".", ".."}
    return guest_command(cmd, read=[root],
                         write=[work, scratch_home(work), *own, *(root / top for top in sorted(tops))],
                         network="loopback")


class SpawnedChild(PopenChild):
    """A spawned job process; ``lost`` as for :class:`ForkedChild`."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        super().__init__(proc)
        self.lost = False


class ForkedChild:
    """A child of the worker: the worker reaps it and reports its status to us."""

    def __init__(self, pid: int, exits: queue.Queue[int | None]) -> None:
        self.pid, self.lost, self._exits = pid, False, exits
        self._code: int | None = None

    def wait(self, timeout: float) -> int | None:
        if self._code is None and not self.lost:
            try:
                code = self._exits.get(timeout=max(timeout, 0.0))
            except queue.Empty:
                # Two may wait (the runner and a cancellation's ladder): the other may have the status.
                return -9 if self.lost else self._code
            self.lost = code is None
            self._code = code
        return -9 if self.lost else self._code


class Worker:
    """The pytest session that collects once and forks jobs (see kiln.tasks.testing.pytest_server)."""

    def __init__(self, paths: Sequence[str], root: Path, work: Path, options: RunOptions) -> None:
        self.options, self.work = options, work
        cmd_r, self._cmd_w = os.pipe()
        evt_r, evt_w = os.pipe()
        args = [options.python, *worker_args(options.python), "serve", "--commands-fd", str(cmd_r),
                "--events-fd", str(evt_w), *sum((["--preload", m] for m in options.preload), []),
                "--", *pytest_argv(paths, options)]
        logger.info("starting the test worker: %s", " ".join(args))
        self.log = work / "worker.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(sandboxed(args, root, work, paths), cwd=root,
                                         env=process_env(work, options.env, options.pass_env), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, pass_fds=(cmd_r, evt_w),
                                         start_new_session=True)
        self._child = SpawnedChild(self.proc)
        os.close(cmd_r)
        os.close(evt_w)
        self._events = os.fdopen(evt_r, "r", encoding="utf-8")
        self._boxes = Mailboxes()
        threading.Thread(target=self._read, name="kiln-worker-events", daemon=True).start()
        register(self._child, grace_s=options.grace_s)  # the fork server's group: a cancellation ends it

    def _read(self) -> None:
        for line in self._events:
            event = json.loads(line)
            kind = event["event"]
            key = "collected" if kind == "collected" else f"{event['job']}:{'exit' if kind == 'exited' else 'start'}"
            self._boxes.box(key).put(event)
        self._boxes.lose()  # EOF: the worker is gone; wake everyone who waits on it

    def collect(self) -> dict[str, Any] | None:
        """The collected items and collection errors, or None if the worker died or hung."""
        try:
            collected: dict[str, Any] = self._boxes.box("collected").get(timeout=self.options.collect_timeout_s)
            return collected
        except queue.Empty:
            return None

    def launch(self, job: Job, env: Mapping[str, str], results: Path, stacks: Path) -> ForkedChild | None:
        """Fork ``job``; None when the worker refused (GPU initialised) or is lost."""
        exits: queue.Queue[int | None] = queue.Queue()
        started = self._boxes.box(f"{job.id}:start")
        command = {"cmd": "run", "job": job.id, "items": [i.index for i in job.items], "env": dict(env),
                   "results": str(results), "stacks": str(stacks)}
        with self._boxes.lock:
            if self._boxes.lost:
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
        event = self._boxes.box(f"{job_id}:exit").get()
        exits.put(None if event is None else int(event["returncode"]))

    def close(self) -> LadderResult:
        try:
            os.write(self._cmd_w, b'{"cmd": "exit"}\n')
        except OSError:
            pass  # already gone
        os.close(self._cmd_w)
        unregister(self._child)
        if cancel_requested():  # the cancellation's ladder has it, or is about to: end it now, no wait for exit
            return terminate(self._child, self.options.grace_s, dump=False)
        return run_with_deadline(self._child, 30.0, self.options.grace_s)

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
    args = [options.python, *worker_args(options.python), "run", "--results", str(results), "--stacks", str(stacks),
            "--", *pytest_argv([i.nodeid for i in job.items], replace(options, markers=""))]
    logger.info("spawning %s", " ".join(args))
    log = open(results.with_suffix(".log"), "wb")
    try:
        proc = subprocess.Popen(sandboxed(args, root, results.parent, [i.nodeid for i in job.items]), cwd=root,
                                env=process_env(results.parent, {**options.env, **env}, options.pass_env),
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
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # not ours to judge here; read_records skips it too
            self.current = record.get("begin")
            self.since = time.monotonic()


