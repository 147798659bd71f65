"""Distributed tests: ``run(fn, world_size)`` on ranks that cannot race for a port.

Ranks rendezvous through a file in a fresh temporary directory per call
(``file://``), never a TCP port chosen in advance: two groups that pick the
same port can hang, or worse, join each other and pass with wrong sums.

Every rank leads its own process group and has the whole call's deadline. If
a rank raises, the others are torn down at once (a survivor would block in a
collective until its own timeout) and :class:`DistributedTestError` names the
failing ranks with their tracebacks; a hung rank ends in
:class:`TestTimeoutError` with every rank's stacks.

Ranks are forked from a fork server (a fresh interpreter that imported
torch.distributed and never touched a GPU) or spawned (``start="spawn"``);
the start method is a local multiprocessing context, never the global one.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import wait as wait_any
from pathlib import Path
from typing import Any, Literal

from kiln.core.errors import DistributedTestError, InfrastructureError, InvalidInputError, TestTimeoutError
from kiln.core.fsutil import atomic_write_bytes
from kiln.tasks.process import die_with_parent, dump_stacks, install_stack_dump, signal_name, terminate
from kiln.tasks.testing.classify import is_infrastructure_exception
from kiln.tasks.testing.devices import detect_gpu_count
from kiln.tasks.testing.jobs import PRELOAD as TEST_PRELOAD
from kiln.tasks.testing.jobs import START_METHODS, StartMethod

logger = logging.getLogger(__name__)

Backend = Literal["gloo", "nccl"]
GRACE_S = 2.0
STARTUP_TIMEOUT_S = 300.0  # interpreter start, imports and rendezvous; generous for a loaded machine
# What the fork server imports for every rank: the test worker's list (the lazy imports of a custom
# op's first call among them: torch._dynamo alone was 1.4 s of every rank) and torch.distributed.
PRELOAD = [*TEST_PRELOAD, "torch.distributed"]


def _raised_in_collective(exc: BaseException) -> bool:
    """True when ``exc`` came out of torch.distributed itself: a peer failed or went away.

    NCCL raises ``DistError``; gloo raises a plain ``RuntimeError`` from inside a
    collective, so the innermost frame tells where the failure was noticed.
    """
    try:
        import torch.distributed as dist

        if isinstance(exc, dist.DistError):
            return True
        package = os.path.dirname(dist.__file__)
    except (ImportError, AttributeError):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(package + os.sep)


def _outcome_of(exc: BaseException) -> dict[str, Any]:
    collective = _raised_in_collective(exc)
    return {"error": "".join(traceback.format_exception(exc)), "infra": is_infrastructure_exception(exc),
            "type": type(exc).__name__, "collective": collective, "at": time.time()}


def _write_outcome(workdir: str, rank: int, outcome: dict[str, Any]) -> None:
    try:
        data = pickle.dumps(outcome)
    except Exception as exc:
        data = pickle.dumps({"error": f"rank {rank} returned a value that cannot be pickled: {exc}", "infra": False,
                             "collective": False, "at": time.time()})
    atomic_write_bytes(Path(workdir) / f"rank{rank}.result", data)


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, backend: str, init_method: str,
               timeout: float, args: Sequence[Any], workdir: str, startup_timeout: float = STARTUP_TIMEOUT_S) -> None:
    os.setpgid(0, 0)  # the rank's helpers die with it
    die_with_parent()  # a killed test (its fork server, or the test itself) takes its ranks along
    stacks = install_stack_dump(Path(workdir) / f"rank{rank}.stacks")  # noqa: F841 — must stay open
    outcome: dict[str, Any]
    try:
        import torch.distributed as dist

        if backend == "nccl":
            import torch

            torch.cuda.set_device(rank)  # one device per rank
        # The group's timeout bounds the rendezvous too: it covers the start-up of the slowest
        # peer (a rank spawned seconds after this one on a loaded machine must still find it
        # waiting), then outlasts the parent's deadline so a hang is reported as a hang (with
        # stacks), not as a peer's timeout error.
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=startup_timeout + 2 * timeout + 5))
        # gloo returns from init on a rank whose own connections are up while a peer is still
        # connecting; a rank that then fails at once would close the mesh under that peer, whose
        # init error reads as a consequence. The barrier lets no rank start the test alone.
        dist.barrier()
        (Path(workdir) / f"rank{rank}.began").touch()  # the deadline counts from here (see _supervise)
        try:
            outcome = {"value": fn(rank, world_size, *args)}
        except BaseException as exc:
            # Written before the group is destroyed: destroying it makes the peers
            # fail, and the parent must see this rank's error as the first one.
            outcome = _outcome_of(exc)
            _write_outcome(workdir, rank, outcome)
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent, which decides what it means
        outcome = _outcome_of(exc)
    _write_outcome(workdir, rank, outcome)
    os._exit(0 if "value" in outcome else 1)


class _Rank:
    """Adapts a multiprocessing.Process to kiln.tasks.process's Child protocol."""

    def __init__(self, process: multiprocessing.process.BaseProcess, stacks: Path) -> None:
        self.process, self.stacks = process, stacks
        self.pid = process.pid or 0

    def wait(self, timeout: float) -> int | None:
        self.process.join(timeout)
        return self.process.exitcode


def _context(start: StartMethod) -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context(start)
    if start == "forkserver":
        context.set_forkserver_preload(PRELOAD)  # only takes effect before the server first starts
    return context


def _validate(world_size: int, backend: str, timeout: float, start: str) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise InvalidInputError(f"world_size={world_size!r} must be a positive integer")
    if backend not in ("gloo", "nccl"):
        raise InvalidInputError(f"backend={backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
    if not timeout > 0:
        raise InvalidInputError(f"timeout={timeout!r} must be > 0 seconds")
    if start not in START_METHODS:
        raise InvalidInputError(f"start={start!r}: use {' or '.join(map(repr, START_METHODS))}")
    if backend == "nccl" and world_size > detect_gpu_count():
        raise InvalidInputError(f"backend='nccl' with world_size={world_size} needs {world_size} GPUs, "
                                f"{detect_gpu_count()} available")


def run(fn: Callable[..., Any], world_size: int, backend: Backend = "gloo", timeout: float = 60,
        args: Sequence[Any] = (), *, start: StartMethod = "forkserver",
        startup_timeout: float = STARTUP_TIMEOUT_S) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; their return values in rank order.

    ``timeout`` bounds ``fn`` itself: it starts once every rank has joined the
    group. Starting the ranks and the rendezvous have ``startup_timeout`` of
    their own, so a loaded machine's slow interpreter start-up is never
    mistaken for a hang of the test. ``fn`` and ``args`` must be picklable (a
    module-level function).
    """
    _validate(world_size, backend, timeout, start)
    if not startup_timeout > 0:
        raise InvalidInputError(f"startup_timeout={startup_timeout!r} must be > 0 seconds")
    workdir = Path(tempfile.mkdtemp(prefix="kiln-dist-"))
    context = _context(start)
    ranks: list[_Rank] = []
    try:
        with _sigterm_unwinds():
            return _start_and_collect(fn, world_size, backend, timeout, args, startup_timeout, workdir, context, ranks)
    finally:
        for rank in ranks:  # nothing outlives the call, whatever happened above
            if rank.process.exitcode is None:
                terminate(rank, GRACE_S, dump=False)
        shutil.rmtree(workdir, ignore_errors=True)


class _Terminated(BaseException):
    """SIGTERM reached the test (its deadline or a cancellation): unwind, so the ranks go down the ladder."""


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While ranks run, SIGTERM raises in the test instead of killing it outright.

    The ranks lead groups of their own, out of the reach of the runner's
    ``killpg`` of the test's group; unwinding runs :func:`run`'s teardown. Only
    where SIGTERM has its default action and this is the main thread.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def unwind(signum: int, frame: object) -> None:
        raise _Terminated(f"signal {signum}")

    signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _start_and_collect(fn: Callable[..., Any], world_size: int, backend: Backend, timeout: float,
                       args: Sequence[Any], startup_timeout: float, workdir: Path,
    # Any: a multiprocessing context, spawn or forkserver (typeshed types each start method apart)
                       context: Any, ranks: list[_Rank]) -> list[Any]:
    init_method = (workdir / "rendezvous").as_uri()
    for rank in range(world_size):
        process = context.Process(
            target=_rank_main,
            name=f"kiln-rank{rank}",
            daemon=False,
            args=(fn, rank, world_size, backend, init_method, timeout, tuple(args), str(workdir),
                  startup_timeout),
        )
        process.start()
        ranks.append(_Rank(process, workdir / f"rank{rank}.stacks"))
    logger.info("started %d %s ranks, rendezvous %s", world_size, backend, init_method)
    deadline = _Deadline(workdir, world_size, timeout, startup_timeout)
    hung, torn_down = _supervise(ranks, deadline)
    if hung and not deadline.started:
        waiting = [rank for rank, marker in enumerate(deadline.markers) if not marker.exists()]
        raise TestTimeoutError(f"distributed test did not start within {startup_timeout:g}s; ranks {waiting} "
                               f"had not joined the group (interpreter start-up, imports, rendezvous)")
    return _collect(ranks, workdir, hung, torn_down, timeout)


class _Deadline:
    """The call's deadline: start-up until every rank has begun ``fn``, then ``timeout`` from there."""

    def __init__(self, workdir: Path, world_size: int, timeout: float, startup_timeout: float) -> None:
        self.markers = [workdir / f"rank{rank}.began" for rank in range(world_size)]
        self.timeout = timeout
        self.at = time.monotonic() + startup_timeout
        self.started = False

    def __call__(self) -> float:
        if not self.started and all(marker.exists() for marker in self.markers):
            self.started = True
            self.at = time.monotonic() + self.timeout
        return self.at


def _supervise(ranks: list[_Rank], deadline: Callable[[], float]) -> tuple[dict[int, str], set[int]]:
    """Wait for every rank; on a failure tear the rest down, on the deadline dump and kill.

    Returns the stacks of ranks still running at the deadline, and the ranks
    torn down because another one failed.
    """
    while any(r.process.exitcode is None for r in ranks):
        remaining = deadline() - time.monotonic()
        if remaining <= 0:
            return _teardown(ranks, dump=True), set()
        wait_any([r.process.sentinel for r in ranks if r.process.exitcode is None], timeout=min(remaining, 0.5))
        if any(r.process.exitcode not in (None, 0) for r in ranks):
            return {}, set(_teardown(ranks, dump=False))
    return {}, set()


def _teardown(ranks: list[_Rank], dump: bool) -> dict[int, str]:
    running = {index: rank for index, rank in enumerate(ranks) if rank.process.exitcode is None}
    # Every stack first: once one rank dies its peers unwind into error paths.
    stacks = {index: dump_stacks(rank, rank.stacks) if dump else "" for index, rank in running.items()}
    for rank in running.values():
        terminate(rank, GRACE_S, dump=False)
    return stacks


def _read_outcome(path: Path) -> dict[str, Any] | None:
    try:
        outcome: dict[str, Any] = pickle.loads(path.read_bytes())
        return outcome
    except (FileNotFoundError, EOFError, pickle.UnpicklingError):
        return None


def _causes(errors: dict[int, dict[str, Any]]) -> list[int]:
    """Ranks whose failure is a cause, not a peer's reaction to it.

    A rank whose collective failed because a peer went away (``DistError``) is a
    consequence; if every failure is of that kind, the earliest one is the cause.
    """
    causes = [rank for rank, outcome in errors.items() if not outcome.get("collective")]
    if causes or not errors:
        return sorted(causes)
    return [min(errors, key=lambda rank: errors[rank].get("at", 0.0))]


def _collect(ranks: list[_Rank], workdir: Path, hung: dict[int, str], torn_down: set[int],
             timeout: float) -> list[Any]:
    values: list[Any] = []
    errors: dict[int, dict[str, Any]] = {}
    crashes: dict[int, str] = {}
    for index, rank in enumerate(ranks):
        outcome = None if index in hung else _read_outcome(workdir / f"rank{index}.result")
        if outcome is not None and "value" in outcome:
            values.append(outcome["value"])
        elif outcome is not None:
            errors[index] = outcome  # torn-down ranks too: one may have failed first
        elif index not in hung and index not in torn_down:
            crash = signal_name(rank.process.exitcode) or f"exit status {rank.process.exitcode}"
            dump = (workdir / f"rank{index}.stacks").read_text(errors="replace")
            crashes[index] = f"rank {index} died ({crash}) without a result\n{dump}".rstrip()
    if hung and not errors and not crashes:
        detail = "\n".join(f"rank {i} stacks:\n{text}" for i, text in sorted(hung.items()))
        raise TestTimeoutError(f"distributed test timed out after {timeout:g}s; hung ranks {sorted(hung)}\n{detail}")
    if not errors and not crashes:
        return values
    causes = sorted(set(_causes(errors)) | set(crashes))
    consequences = sorted(set(errors) - set(causes))
    stopped = sorted(torn_down - set(errors))
    parts = [f"{len(causes)} of {len(ranks)} ranks failed (ranks {causes})"]
    if consequences:
        parts.append(f"ranks {consequences} failed as a consequence")
    if stopped:
        parts.append(f"ranks {stopped} were torn down")
    details = [crashes[i] if i in crashes else f"rank {i} raised:\n{errors[i]['error']}" for i in causes]
    details += [f"rank {i} (consequence) raised:\n{errors[i]['error']}" for i in consequences]
    message = "; ".join(parts) + "\n" + "\n".join(details)
    infra = not crashes and all(errors[i].get("infra") for i in causes)
    raise (InfrastructureError if infra else DistributedTestError)(message)
