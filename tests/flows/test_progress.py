"""Stage progress for the person at the terminal: a rich bar on a tty, plain lines otherwise."""

from __future__ import annotations

import io
from types import SimpleNamespace

from kiln.flows.report import progress


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


def test_prefects_lines_around_the_progress_hook_are_dropped_but_its_errors_kept(caplog):
    import logging

    hook = progress.task_hook("build")
    assert hook.__name__ == progress.HOOK_NAME
    logger = logging.getLogger("prefect.task_runs")
    with caplog.at_level(logging.INFO, logger="prefect.task_runs"):
        logger.info(f"Running hook {hook.__name__!r} in response to entering state 'Completed'")
        logger.info(f"Hook {hook.__name__!r} finished running successfully")
        logger.error(f"An error was encountered while running hook {hook.__name__!r}")
        logger.info("Running hook 'notify_team' in response to entering state 'Failed'")
        logger.info("Finished in state Completed()")
    assert [r.getMessage() for r in caplog.records] == [
        "An error was encountered while running hook 'kiln_progress'",
        "Running hook 'notify_team' in response to entering state 'Failed'",
        "Finished in state Completed()"]


def test_under_a_live_bar_the_console_drops_each_units_finished_line_but_keeps_failures():
    import logging

    stream, sent = io.StringIO(), io.StringIO()
    console = logging.StreamHandler(stream)  # stands for Prefect's console handler on the root logger
    api = logging.StreamHandler(sent)  # stands for Prefect's API handler, on the task runs' own logger
    root, logger = logging.getLogger(), logging.getLogger("prefect.task_runs")
    root.addHandler(console)
    logger.addHandler(api)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with progress.showing(progress.RichReporter(_Tty())):
            logger.info("Finished in state Completed()")
            logger.error("Finished in state Failed('Task run encountered an exception')")
            logger.info("compiling add for 9.0")
        logger.info("Finished in state Completed()")  # no bar any more: shown again
    finally:
        root.removeHandler(console)
        logger.removeHandler(api)
        logger.setLevel(level)
    assert stream.getvalue().splitlines() == ["Finished in state Failed('Task run encountered an exception')",
                                              "compiling add for 9.0", "Finished in state Completed()"]
    assert sent.getvalue().count("Finished in state Completed()") == 2  # the run's log keeps every line


def test_off_a_terminal_every_line_stays():
    import logging

    stream = io.StringIO()
    console = logging.StreamHandler(stream)
    root, logger = logging.getLogger(), logging.getLogger("prefect.task_runs")
    root.addHandler(console)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with progress.showing(progress.PlainReporter(io.StringIO())):
            logger.info("Finished in state Completed()")
    finally:
        root.removeHandler(console)
        logger.setLevel(level)
    assert stream.getvalue().splitlines() == ["Finished in state Completed()"]
