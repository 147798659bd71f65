"""The worker side of the isolation runner: a pytest session that forks tests.

``python -m kiln.tasks.testing.pytest_server serve --commands-fd R --events-fd W -- ARGS``
imports torch and triton (never touching a GPU), collects ``ARGS`` with
pytest once, reports the collected items, then serves ``run`` commands: each
forks a child that leads its own process group, pins its devices through the
environment, and runs the given items with ``runtestprotocol``, appending one
JSON line per test to a results file. The fork inherits the imports and the
collection, so a test starts in milliseconds.

``python -m kiln.tasks.testing.pytest_server run --results F --stacks S -- ARGS NODEIDS``
does the same for one job in a fresh interpreter (the ``spawn`` method).

Forking is refused once CUDA is initialised in this process: a fork after
the GPU was touched hangs or corrupts the child's context.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import os
import selectors
import signal
import sys
from collections.abc import Generator
from typing import Any

import pytest

from kiln.tasks.process import die_with_parent, gpu_initialised, install_stack_dump, signal_group, single_threaded
from kiln.tasks.testing.classify import is_assertion_exception, is_infrastructure_exception
from kiln.tasks.testing.touch import Recorder, make_recorder

logger = logging.getLogger(__name__)


def preload(modules: list[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a missing optional import only costs speed
            logger.warning("preload of %s failed: %s", name, exc)
    if gpu_initialised():
        logger.warning("a preloaded module initialised CUDA; forking is refused, jobs fall back to spawn")


def warm_up() -> int | None:
    """Pay torch's lazy first-call costs once, here, so no forked test pays them again.

    Returns the intra-op thread count to restore in each child. The server
    itself stays single-threaded: a child forked after OpenMP started its
    thread pool inherits a pool with no threads and hangs in its first
    parallel op.
    """
    threads = single_threaded()
    if threads is None:
        return None
    torch = sys.modules["torch"]
    x = torch.ones(4, 4)
    torch.testing.assert_close(x @ x, x @ x)  # its first call alone costs seconds of lazy imports
    return threads


def _phase_record(report: pytest.TestReport) -> dict[str, Any]:
    longrepr = report.longrepr
    message = ""
    if report.skipped and isinstance(longrepr, tuple):
        message, longrepr = str(longrepr[2]), str(longrepr[2])
    elif longrepr is not None:
        message = getattr(getattr(longrepr, "reprcrash", None), "message", "") or ""
    sections = dict(report.sections)
    return {
        "when": report.when, "outcome": report.outcome, "duration": report.duration,
        "kind": getattr(report, "kiln_kind", ""), "message": message,
        "longrepr": "" if longrepr is None else str(longrepr),
        "stdout": sections.get(f"Captured stdout {report.when}", ""),
        "stderr": sections.get(f"Captured stderr {report.when}", ""),
    }


# Any: an open text file of the worker's (its type varies with how it was opened)
def _write(handle: Any, record: dict[str, Any]) -> None:
    handle.write(json.dumps(record) + "\n")
    handle.flush()


def run_items(items: list[pytest.Item], results_path: str, recorder: Recorder | None = None) -> None:
    """Run ``items`` in this process, one result line per test, a ``begin`` line before each.

    With ``recorder``, the last phase record of each test carries ``touched``: what the test touched
    (:mod:`kiln.tasks.testing.touch`; an empty list when nothing could be recorded).
    """
    from _pytest.runner import runtestprotocol

    if recorder is not None and not recorder.installed:
        recorder.exclude(os.path.dirname(os.path.abspath(results_path)))  # Kiln's work directory: results, stacks
        recorder.install()
    with open(results_path, "a", encoding="utf-8") as handle:
        for index, item in enumerate(items):
            _write(handle, {"begin": item.nodeid})
            nextitem = items[index + 1] if index + 1 < len(items) else None
            if recorder is not None:
                recorder.begin()
            phases = [_phase_record(r) for r in runtestprotocol(item, nextitem=nextitem, log=False)]
            if recorder is not None and phases:
                phases[-1]["touched"] = list(recorder.finish(item.path))
            _write(handle, {"result": item.nodeid, "phases": phases})


def recorder_for(session: pytest.Session) -> Recorder | None:
    """The recorder of what this session's tests touch, or None when recording is impossible here.

    Built before any fork, so every child shares its index of the wheel's files.
    """
    try:
        config = session.config
        return make_recorder(config.invocation_params.dir, [item.path for item in session.items],
                             inifile=config.inipath)
    except Exception as exc:  # recording is an optimisation's input: its failure never stops the tests
        logger.warning("what tests touch will not be recorded: %s: %s", type(exc).__name__, exc)
        return None


def _fresh_capture(config: pytest.Config) -> None:
    """Give a forked child its own capture files; the server's are shared by every fork."""
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None and capman.is_globally_capturing():
        capman.stop_global_capturing()
        capman.start_global_capturing()


class KilnPlugin:
    """Labels each failing phase with the kind of exception that caused it."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator[None, Any, None]:
        outcome = yield
        report = outcome.get_result()
        excinfo = call.excinfo
        if excinfo is None or report.outcome != "failed":
            return
        if is_infrastructure_exception(excinfo.value):
            report.kiln_kind = "infrastructure"
        elif is_assertion_exception(excinfo.value):
            report.kiln_kind = "assertion"
        else:
            report.kiln_kind = "exception"


class ServePlugin(KilnPlugin):
    def __init__(self, commands_fd: int, events_fd: int, threads: int | None) -> None:
        self.commands_fd, self.threads = commands_fd, threads
        self.pending = b""
        self.events = os.fdopen(events_fd, "w", encoding="utf-8")
        self.collect_errors: list[dict[str, str]] = []
        self.children: dict[int, tuple[str, int]] = {}  # pidfd → (job, pid)
        self.recorder: Recorder | None = None

    def send(self, record: dict[str, Any]) -> None:
        _write(self.events, record)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collect_errors.append({"nodeid": report.nodeid or "<collection>", "longrepr": str(report.longrepr)})

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        # Everything loaded so far is shared by every fork; frozen, the collector
        # never writes to those objects' headers, so their pages stay shared
        # instead of being copied into each child on its first collection.
        self.recorder = recorder_for(session)
        gc.freeze()
        items = [{"nodeid": it.nodeid, "file": it.nodeid.split("::", 1)[0], "gpus": _gpus(it)} for it in session.items]
        self.send({"event": "collected", "items": items, "errors": self.collect_errors})
        try:
            self.serve(session)
        finally:
            for _job, pid in self.children.values():
                signal_group(pid, signal.SIGKILL)  # no grace: the runner is gone or done
        return True

    def serve(self, session: pytest.Session) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.commands_fd, selectors.EVENT_READ, "commands")
        while True:
            for key, _ in selector.select():
                if key.data != "commands":
                    self.reap(key.fileobj, selector)
                    continue
                # Raw reads: a buffered reader could hold a second command that select never reports.
                chunk = os.read(self.commands_fd, 1 << 16)
                if not chunk:  # the runner went away: nothing may outlive it
                    return
                *lines, self.pending = (self.pending + chunk).split(b"\n")
                for line in lines:
                    command = json.loads(line)
                    if command["cmd"] == "exit":
                        return
                    self.start(session, command, selector)

    def start(self, session: pytest.Session, command: dict[str, Any], selector: selectors.BaseSelector) -> None:
        if gpu_initialised():
            self.send({"event": "refused", "job": command["job"], "reason": "CUDA is initialised in the fork server"})
            return
        items = [session.items[i] for i in command["items"]]
        pid = os.fork()
        if pid == 0:
            self._child(session, items, command)
        try:
            os.setpgid(pid, pid)  # also done in the child; whichever runs first wins the race
        except (PermissionError, ProcessLookupError):
            pass
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = (command["job"], pid)
        selector.register(pidfd, selectors.EVENT_READ, "child")
        self.send({"event": "started", "job": command["job"], "pid": pid})

    def _child(self, session: pytest.Session, items: list[pytest.Item], command: dict[str, Any]) -> None:
        code = 0
        try:
            os.setpgid(0, 0)
            die_with_parent()
            os.close(self.commands_fd)
            self.events.close()
            os.environ.update(command["env"])
            if self.threads is not None:
                sys.modules["torch"].set_num_threads(self.threads)
            install_stack_dump(command["stacks"])
            _fresh_capture(session.config)
            run_items(items, command["results"], self.recorder)
        except BaseException:  # the child must never return into the server's loop
            import traceback

            traceback.print_exc()
            code = 70
        finally:
            os._exit(code)

    # Any: a pidfd as the selector registered it (an int or a file object)
    def reap(self, pidfd: Any, selector: selectors.BaseSelector) -> None:
        job, pid = self.children.pop(pidfd)
        selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        self.send({"event": "exited", "job": job, "returncode": os.waitstatus_to_exitcode(status)})


class RunPlugin(KilnPlugin):
    """The spawn method: run the collected items in this (fresh) process."""

    def __init__(self, results: str, stacks: str) -> None:
        self.results, self.stacks_path = results, stacks

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        # Installed here, after pytest's own faulthandler plugin pointed it at stderr.
        self.stacks = install_stack_dump(self.stacks_path)
        run_items(list(session.items), self.results, recorder_for(session))
        return True


def _gpus(item: pytest.Item) -> int:
    marker = item.get_closest_marker("gpus")
    if marker is None:
        return 0
    value = marker.args[0] if marker.args else marker.kwargs.get("n", 1)
    return int(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.tasks.testing.pytest_server")
    parser.add_argument("mode", choices=("serve", "run"))
    parser.add_argument("--commands-fd", type=int)
    parser.add_argument("--events-fd", type=int)
    parser.add_argument("--results")
    parser.add_argument("--stacks")
    parser.add_argument("--preload", action="append", default=[])
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ns = parser.parse_args(argv[:split])
    args = argv[split + 1:]
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    preload(ns.preload)
    if ns.mode == "serve":
        plugin: KilnPlugin = ServePlugin(ns.commands_fd, ns.events_fd, warm_up())
    else:
        plugin = RunPlugin(ns.results, ns.stacks)
    return int(pytest.main(args, plugins=[plugin]))


if __name__ == "__main__":
    sys.exit(main())
