"""kiln.flows.run.common.side_reports: reports sent on threads, all sent by the block's end, none lost silently."""

from __future__ import annotations

import contextvars
import logging
import threading

from kiln.flows.run.common import side_reports

WHO: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="nobody")


def test_every_report_is_sent_in_the_callers_context_before_the_block_ends():
    seen: list[tuple[str, str]] = []
    WHO.set("the flow")
    with side_reports() as report:
        for n in range(5):
            report(lambda n: seen.append((WHO.get(), f"{n} on {threading.current_thread().name}")), n)
    assert len(seen) == 5  # all sent when the block ends
    assert all(who == "the flow" and "kiln-report" in where for who, where in seen)


def test_a_report_that_raises_is_logged_and_the_others_still_go(caplog):
    sent: list[int] = []

    def broken() -> None:
        raise RuntimeError("the server went away mid-report")

    with caplog.at_level(logging.WARNING, logger="kiln.flows.run.common"), side_reports() as report:
        report(broken)
        report(sent.append, 1)
    assert sent == [1]
    assert "a side report failed: RuntimeError: the server went away mid-report" in caplog.text
