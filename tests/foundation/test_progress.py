"""Stage progress for the person at the terminal: a rich bar on a tty, plain lines otherwise."""

from __future__ import annotations

import io
from types import SimpleNamespace

from kiln.flows import progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_off_a_terminal_and_a_bar_on_one():
    assert isinstance(progress.reporter_for(io.StringIO()), progress.PlainReporter)
    bar = progress.reporter_for(_Tty())
    assert isinstance(bar, progress.RichReporter)
    bar.close()


def test_task_hooks_report_each_finished_unit_to_the_installed_reporter():
    stream = io.StringIO()
    hook = progress.task_hook("build")
    hook(None, SimpleNamespace(name="compile cu130/9.0/add"), SimpleNamespace(name="Completed"))  # no reporter yet
    with progress.showing(progress.PlainReporter(stream)):
        progress.expect("build", 2)
        hook(None, SimpleNamespace(name="compile cu130/9.0/add"), SimpleNamespace(name="Completed"))
        hook(None, SimpleNamespace(name="compile cu130/8.0/add"), SimpleNamespace(name="Failed"))
    hook(None, SimpleNamespace(name="after"), SimpleNamespace(name="Completed"))  # uninstalled again
    assert stream.getvalue().splitlines() == ["[build] 1/2 compile cu130/9.0/add: Completed",
                                              "[build] 2/2 compile cu130/8.0/add: Failed"]


def test_the_bar_counts_units_against_the_stage_total():
    reporter = progress.RichReporter(_Tty())
    try:
        reporter.expect("test", 3)
        reporter.done("test", "test/kernels/cpu", "Completed")
        (task,) = reporter.progress.tasks
        assert (task.description, task.total, task.completed) == ("test", 3, 1)
        assert task.fields["last"] == "test/kernels/cpu: Completed"
    finally:
        reporter.close()
