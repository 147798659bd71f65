"""Nightly and variant versions go through packaging and refuse bad input."""

from __future__ import annotations

import datetime

import pytest
from packaging.version import Version

from release.errors import InvalidInputError
from tasks.versioning import check_version, nightly_version, variant_version


def test_nightly_version_adds_the_date_as_a_dev_release():
    assert nightly_version("0.1.0", datetime.date(2026, 11, 29)) == "0.1.0.dev20261129"
    assert Version(nightly_version("1.2", datetime.date(2026, 1, 2))) < Version("1.2")


def test_variant_version_is_a_local_label():
    version = variant_version("0.1.0.dev20261129", "cu130")
    assert version == "0.1.0.dev20261129+cu130"
    assert Version(version).local == "cu130"


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: nightly_version("banana", datetime.date(2026, 1, 1)), "not a PEP 440 version"),
        (lambda: nightly_version("0.1.0.dev3", datetime.date(2026, 1, 1)), "neither a .dev"),
        (lambda: variant_version("0.1.0+cu130", "rocm"), "already has a local part"),
        (lambda: variant_version("0.1.0", "CU-130"), "cannot be a PEP 440 local label"),
        (lambda: check_version("1.0+x"), "already has a local part"),
    ],
)
def test_bad_versions_are_refused(call, needle):
    with pytest.raises(InvalidInputError, match=needle):
        call()
