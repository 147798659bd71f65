"""Progress of the long stages (build, test, bench) for the person at the terminal.

The ``kiln`` command line installs a reporter for the flow it runs in this
process: a ``rich`` progress bar per stage when stderr is a terminal, one
plain line per finished unit otherwise (CI logs, pipes). Flows say how many
units a stage has (:func:`expect`); the stage's unit tasks report when they
end through Prefect state hooks (:func:`task_hook`). Without a reporter
(a deployment run on a worker, tests) nothing is shown.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol, TextIO

if TYPE_CHECKING:
    from prefect import State, Task
    from prefect.client.schemas.objects import TaskRun


class Reporter(Protocol):
    def expect(self, stage: str, total: int) -> None: ...

    def done(self, stage: str, name: str, state: str) -> None: ...

    def close(self) -> None: ...


class _Silent:
    def expect(self, stage: str, total: int) -> None:
        pass

    def done(self, stage: str, name: str, state: str) -> None:
        pass

    def close(self) -> None:
        pass


class PlainReporter:
    """``[test] 2/5 test/kernels/cpu: Completed`` — one line per finished unit."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.totals: dict[str, int] = {}
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def expect(self, stage: str, total: int) -> None:
        with self._lock:
            self.totals[stage] = total

    def done(self, stage: str, name: str, state: str) -> None:
        with self._lock:
            self.counts[stage] = self.counts.get(stage, 0) + 1
            total = self.totals.get(stage)
            print(f"[{stage}] {self.counts[stage]}{f'/{total}' if total else ''} {name}: {state}", file=self.stream,
                  flush=True)

    def close(self) -> None:
        pass


class RichReporter:
    """One ``rich`` progress bar per stage, on stderr, above the log lines."""

    def __init__(self, stream: TextIO) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[last]}"), TimeElapsedColumn(),
                                 console=Console(file=stream), transient=False)
        self.bars: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.progress.start()

    def _bar(self, stage: str) -> Any:
        if stage not in self.bars:
            self.bars[stage] = self.progress.add_task(stage, total=None, last="")
        return self.bars[stage]

    def expect(self, stage: str, total: int) -> None:
        with self._lock:
            self.progress.update(self._bar(stage), total=total)

    def done(self, stage: str, name: str, state: str) -> None:
        with self._lock:
            self.progress.update(self._bar(stage), advance=1, last=f"{name}: {state}")

    def close(self) -> None:
        self.progress.stop()


_current: Reporter = _Silent()


def reporter_for(stream: TextIO = sys.stderr) -> Reporter:
    """A bar on a terminal, plain lines anywhere else."""
    return RichReporter(stream) if stream.isatty() else PlainReporter(stream)


class _UnitEnds(logging.Filter):
    """Drops Prefect's "Finished in state Completed()" line of each unit from the terminal while a live bar
    counts the units: one line per unit (218 for a default nightly) would scroll the bar away. Only the console
    loses them: the run's log on the server keeps every line, and a unit that failed is logged as an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "prefect.task_runs" and record.levelno == logging.INFO
                    and record.getMessage().startswith("Finished in state "))


def _console_handlers() -> list[logging.Handler]:
    """The root logger's handlers that write to a stream (Prefect's console handler), not to the API."""
    return [h for h in logging.getLogger().handlers if isinstance(h, logging.StreamHandler)]


@contextmanager
def showing(reporter: Reporter) -> Iterator[Reporter]:
    """Report this process's stage progress to ``reporter`` while the block runs; under a live bar the console
    shows no per-unit "Finished in state" line."""
    global _current
    previous, _current = _current, reporter
    quiet = _UnitEnds()
    handlers = _console_handlers() if isinstance(reporter, RichReporter) else []
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        yield reporter
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)
        _current = previous
        reporter.close()


def expect(stage: str, total: int) -> None:
    _current.expect(stage, total)


HOOK_NAME = "kiln_progress"


class _QuietHooks(logging.Filter):
    """Drops Prefect's two INFO lines around each run of the progress hook ("Running hook …",
    "Hook … finished running successfully"): two per unit in every task run's log and on the
    server, saying nothing. A hook's error is still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno != logging.INFO or f"{HOOK_NAME!r}" not in record.getMessage()


logging.getLogger("prefect.task_runs").addFilter(_QuietHooks())


def task_hook(stage: str) -> Callable[[Task[..., Any], TaskRun, State], None]:
    """A Prefect ``on_completion``/``on_failure`` hook: one unit of ``stage`` ended."""

    def hook(task: Task[..., Any], task_run: TaskRun, state: State) -> None:
        _current.done(stage, getattr(task_run, "name", "unit"), getattr(state, "name", "ended"))

    hook.__name__ = hook.__qualname__ = HOOK_NAME
    return hook
