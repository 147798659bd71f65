"""One measuring process per kernel, without paying an interpreter start per kernel.

``python -P -m kiln.tasks.bench.measure serve --config C --size S --metric M``
imports torch, Triton and the project's registry from the environment's
installed wheel once (never touching a GPU), then serves requests on stdin,
one JSON line each (``{"kernel": K or null, "out": F, "log": L}``): it forks a
child that leads its own session, writes its output to ``L`` and its answer to
``F`` exactly as a fresh ``measure`` process would, and reports
``{"forked": pid}`` then ``{"exited": pid, "code": c}`` on stdout. A crashed or
hung kernel is one child: the next request forks from the same clean parent.

Forking is refused (``{"refused": why}``) once CUDA is initialised in the
server (a fork after the GPU was touched hangs or corrupts the child's
context); :class:`MeasureServer` then measures in a fresh process instead.

The server's process group is registered with the cancellation registry of
:mod:`kiln.tasks.process` from its start, so one SIGTERM to the command ends it
(its forked children die with it), and a cancelled run starts no new server.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, TextIO

from kiln.core.sandbox import guest_command, guest_environ
from kiln.tasks.process import (
    Mailboxes,
    PopenChild,
    cancel_requested,
    check_cancelled,
    die_with_parent,
    gpu_initialised,
    register,
    run_with_deadline,
    terminate,
    unregister,
)
from kiln.tasks.testing.workers import ForkedChild

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # the first answer waits for the server's imports; a fork answers in milliseconds
CLOSE_TIMEOUT_S = 10.0
GRACE_S = 1.0


# Any: the measuring module, imported in the environment under test (not Kiln's)
def _child(request: dict[str, Any], measure: Any, threads: int | None) -> None:
    """In the fork: its own session, its own log, the answer file; never returns."""
    code = 1
    try:
        os.setsid()
        die_with_parent()
        if threads is not None:
            sys.modules["torch"].set_num_threads(threads)
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        code = measure(request["kernel"], request["out"])
    except BaseException:  # the answer file stays missing; the log says why
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# Any: the measuring module, imported in the environment under test (not Kiln's)
def serve(requests: TextIO, replies: TextIO, measure: Any, threads: int | None = None) -> int:
    """Fork one child per request line, one at a time; 0 at the end of ``requests``.

    ``threads``: the intra-op thread count each child restores (:func:`kiln.tasks.process.single_threaded`).
    """
    def reply(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    for line in requests:
        request = json.loads(line)
        if gpu_initialised():
            reply({"refused": "CUDA is initialised in the measuring server"})
            continue
        pid = os.fork()
        if pid == 0:
            _child(request, measure, threads)
        reply({"forked": pid})
        _, status = os.waitpid(pid, 0)
        reply({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
    return 0


class _Session:
    """One started server: its replies, and a mailbox per forked child for that child's exit status."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc, self.replies, self.exits = proc, queue.Queue[dict[str, Any] | None](), Mailboxes()
        self.child = PopenChild(proc)
        threading.Thread(target=self._read, name="kiln-measure-server", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            if "exited" in message:
                self.exits.box(message["exited"]).put(message["code"])
            else:
                self.replies.put(message)
        self.exits.lose()  # EOF: the server is gone; wake whoever waits on it
        self.replies.put(None)


class MeasureServer:
    """The bench stage's side of ``measure serve``: one request at a time, restarted if it was lost."""

    def __init__(self, command: list[str], cwd: Path, log: Path) -> None:
        self.command, self.cwd, self.log = command, cwd, log
        self._lock = threading.Lock()
        self._session: _Session | None = None

    def _current(self) -> _Session:
        with self._lock:
            if self._session is None or self._session.proc.poll() is not None:
                if self._session is not None:
                    unregister(self._session.child)
                check_cancelled("the measuring server")
                logger.info("starting the measuring server: %s", " ".join(self.command))
                self.log.parent.mkdir(parents=True, exist_ok=True)
                with open(self.log, "ab") as log:
                    proc = subprocess.Popen(guest_command(self.command, read=[self.cwd], write=[self.log.parent],
                                                          network="loopback"),
                                            cwd=self.cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                            text=True, start_new_session=True,
                                            env=guest_environ(self.log.parent / "home"))
                self._session = _Session(proc)
                register(self._session.child, grace_s=GRACE_S)  # a cancellation ends the server's group
            return self._session

    def fork(self, kernel: str | None, out: Path, log: Path) -> ForkedChild | None:
        """A forked child measuring ``kernel``; None when the server refuses to fork or is lost twice."""
        request = json.dumps({"kernel": kernel, "out": str(out), "log": str(log)}) + "\n"
        for _ in range(2):  # a server lost since the last kernel is started again, once
            session = self._current()
            try:
                assert session.proc.stdin is not None
                session.proc.stdin.write(request)
                session.proc.stdin.flush()
                reply = session.replies.get(timeout=START_TIMEOUT_S)
            except (OSError, queue.Empty) as exc:
                logger.warning("the measuring server did not answer (%s)", exc)
                reply = None
            if reply is not None and "forked" in reply:
                return ForkedChild(reply["forked"], session.exits.box(reply["forked"]))
            if reply is not None:
                logger.warning("the measuring server refused to fork (%s); measuring in a fresh process",
                               reply["refused"])
                return None
            self.close()
        logger.warning("the measuring server was lost twice; measuring in a fresh process")
        return None

    def close(self) -> None:
        """End the server: EOF on its requests, then its process group if it does not go."""
        with self._lock:
            session, self._session = self._session, None
        if session is None:
            return
        unregister(session.child)
        if cancel_requested():  # the cancellation's ladder has it, or is about to: end it now, no wait for EOF
            terminate(session.child, GRACE_S, dump=False)
            return
        try:
            assert session.proc.stdin is not None
            session.proc.stdin.close()
        except OSError:
            pass
        ladder = run_with_deadline(session.child, CLOSE_TIMEOUT_S, grace_s=GRACE_S)
        if ladder.timed_out:
            logger.warning("the measuring server did not exit on EOF; ended by %s", ladder.escalation)
