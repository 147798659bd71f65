"""Nightly and variant versions go through packaging and refuse bad input."""

from __future__ import annotations

import calendar

import pytest
from packaging.version import Version

from kiln.core.errors import InvalidInputError
from kiln.tasks.run.versioning import check_build_version, nightly_version, variant_version


def _utc(*when: int) -> int:
    return calendar.timegm((*when, 0, 0, 0))


def test_nightly_version_is_the_commit_time_as_a_dev_release():
    assert nightly_version("0.1.0", _utc(2026, 11, 29, 21, 7, 3)) == "0.1.0.dev20261129210703"
    assert Version(nightly_version("1.2", _utc(2026, 1, 2, 0, 0, 0))) < Version("1.2")


def test_later_commits_sort_higher_and_the_same_commit_gives_the_same_version():
    earlier, later = _utc(2026, 11, 29, 23, 59, 59), _utc(2026, 11, 30, 0, 0, 1)
    assert Version(nightly_version("0.1.0", earlier)) < Version(nightly_version("0.1.0", later))
    assert nightly_version("0.1.0", later) == nightly_version("0.1.0", later)


def test_outside_git_the_nightly_version_is_dev0():
    assert nightly_version("0.1.0", None) == "0.1.0.dev0"


def test_variant_version_is_a_local_label():
    version = variant_version("0.1.0.dev20261129", "cu130")
    assert version == "0.1.0.dev20261129+cu130"
    assert Version(version).local == "cu130"


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: nightly_version("banana", 0), "not a PEP 440 version"),
        (lambda: nightly_version("0.1.0.dev3", 0), "neither a .dev"),
        (lambda: variant_version("0.1.0+cu130", "rocm"), "already has a local part"),
        (lambda: variant_version("0.1.0", "CU-130"), "cannot be a PEP 440 local label"),
        (lambda: check_build_version("1.0+x"), "already has a local part"),
    ],
)
def test_bad_versions_are_refused(call, needle):
    with pytest.raises(InvalidInputError, match=needle):
        call()
