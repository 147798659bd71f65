"""Dependency checks started ahead of their asker (a nightly starts them after its build): real pip, offline.

The staged index and the ``file://`` dependency index are local, as in test_closure.py. pip's runs are
counted from what :func:`kiln.core.installenv.run_installer` logs before each one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.core.errors import InfrastructureError
from kiln.core.wheels import read_wheel
from kiln.release.publish import closure
from kiln.release.publish.closure import ClosureQuery, Staged, prefetch, resolve_shared
from tests.helpers.wheelkit import make_wheel

from .test_closure import ABSENT, _dependency_index


@pytest.fixture
def messages() -> Iterator[list[str]]:
    """What Kiln logs (from any thread) while the test runs."""
    found: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: found.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("kiln")  # kiln.release.publish.closure, and the installer runs of kiln.core.installenv
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield found
    logger.removeHandler(handler)
    logger.setLevel(level)


def _query(tmp: Path, index: str, requires: list[str]) -> ClosureQuery:
    path = make_wheel(tmp / "-".join(requires), "demo", "1.0.dev1+cpu", requires=requires)
    return ClosureQuery("cpu", Staged(read_wheel(path)[0], path), (), (index,))


def _pip_runs(messages: list[str]) -> int:
    """The resolutions pip ran (not counting the probe after a refusal, which writes no report)."""
    return sum(m.startswith("running ") and " pip install --dry-run " in m and " --report " in m for m in messages)


def test_an_early_check_answers_its_asker_once_with_one_pip_and_other_questions_are_asked_apart(
        tmp_path: Path, messages: list[str]) -> None:
    index = _dependency_index(tmp_path)
    resolves, absent = _query(tmp_path, index, ["helper==2.0"]), _query(tmp_path, index, [ABSENT])
    prefetch([resolves, resolves])
    prefetch([resolves])  # asked while in flight or answered: not started again
    refused = resolve_shared(absent)  # another question: its own pip, whatever the early one is doing
    assert not refused.ok and ABSENT in refused.missing
    answer = resolve_shared(resolves)  # waits for the early check when it is still running
    assert answer == closure.resolve(resolves) and answer.ok
    assert "dependencies of demo==1.0.dev1+cpu (cpu) answered by the check started after the build" in messages
    assert _pip_runs(messages) == 3  # the early check, the other question, and the comparison above
    resolve_shared(resolves)  # an early answer is taken once: the next ask resolves itself
    assert _pip_runs(messages) == 4


def test_an_early_check_that_raised_is_forgotten_and_its_asker_resolves_itself(
        tmp_path: Path, messages: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    query = _query(tmp_path, _dependency_index(tmp_path), ["helper==2.0"])
    real = closure.resolve

    def fault_injection_first_resolve_raises(asked: ClosureQuery, timeout: float = closure.RESOLVE_TIMEOUT_S):
        monkeypatch.setattr(closure, "resolve", real)
        raise InfrastructureError("injected: the index did not answer")

    monkeypatch.setattr(closure, "resolve", fault_injection_first_resolve_raises)
    prefetch([query])
    answer = resolve_shared(query)
    assert answer.ok and _pip_runs(messages) == 1  # the asker's own pip, the real answer
    assert any("did not answer (injected: the index did not answer); the publish stage asks again" in m
               for m in messages), messages
