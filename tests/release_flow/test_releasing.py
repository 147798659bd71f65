"""The release's decisions without Prefect: version checks, the gate, rollback."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from packaging.version import Version

from release.dists import make_distribution
from release.errors import ConfigError, InvalidInputError, RegressionError
from release.index import generate
from release.store import LocalStore
from tasks import releasing
from tasks.config import load_config

REPO = Path(__file__).resolve().parents[2]


def _dist(filename: str):
    return make_distribution(filename, hashlib.sha256(filename.encode()).hexdigest(), 10, 1_700_000_000)


def _publish(store: LocalStore, prefix: str, filenames: list[str]) -> None:
    """Write a channel's pages the way the index module renders them."""
    for key, data in generate(map(_dist, filenames)).items():
        full = f"{prefix}/{key}"
        current = store.get_page(full)
        store.put_page(full, data, "text/html", "no-cache", current[1] if current else None)


@pytest.fixture
def store(tmp_path) -> LocalStore:
    store = LocalStore(tmp_path / "index")
    _publish(store, "release/cpu/simple", ["kiln_kernels-0.1.0+cpu-py3-none-any.whl"])
    _publish(store, "release/cu130/simple", ["kiln_kernels-0.1.0+cu130-py3-none-any.whl",
                                             "kiln_kernels-0.2.0+cu130-py3-none-any.whl"])
    _publish(store, "nightly/cpu/simple", ["kiln_kernels-0.3.0.dev20260101+cpu-py3-none-any.whl"])
    return store


def test_published_versions_reads_every_variant_of_the_channel_only(store):
    assert releasing.published_versions(store, "release", "kiln-kernels") == [Version("0.1.0"), Version("0.2.0")]
    assert releasing.published_versions(store, "nightly", "Kiln_Kernels") == [Version("0.3.0.dev20260101")]
    assert releasing.published_versions(store, "release", "other") == []


@pytest.mark.parametrize(
    "version, needle",
    [
        ("1.0-final-final", "is not a PEP 440 version"),
        ("0.3.0+cu130", "has a local part"),
        ("0.2.0", "already published on the release channel"),
        ("0.2", "already published on the release channel"),  # 0.2 == 0.2.0 under PEP 440
        ("0.1.5", "lower than the last release release 0.2.0"),
    ],
)
def test_check_version_refuses_with_a_clear_message(store, version, needle):
    published = releasing.published_versions(store, "release", "kiln-kernels")
    with pytest.raises(InvalidInputError) as info:
        releasing.check_version(version, "release", published)
    assert needle in str(info.value)


def test_check_version_normalises_an_acceptable_version(store):
    published = releasing.published_versions(store, "release", "kiln-kernels")
    assert releasing.check_version("0.3.0-rc.1", "release", published) == "0.3.0rc1"
    assert releasing.check_version("0.0.1", "release", []) == "0.0.1"


def test_unknown_channel_is_refused_with_the_known_ones():
    config = load_config(REPO / "kiln.toml")
    assert releasing.channel_prefix(config, "nightly") == "nightly"
    with pytest.raises(ConfigError, match=r"unknown channel 'beta'.*\['nightly', 'release'\]"):
        releasing.channel_prefix(config, "beta")


def test_gate_stops_on_failed_tests_even_with_an_override():
    stages = {"build": ("COMPLETED", ""), "test": ("FAILED", "test: 1 of 9 units failed"), "bench": ("COMPLETED", "")}
    with pytest.raises(releasing.ReleaseGateError, match="test: test: 1 of 9 units failed"):
        releasing.check_gate(stages, allow_regressions="known slowdown")


def test_gate_stops_on_regressions_unless_a_reason_is_given():
    stages = {"build": ("COMPLETED", ""), "test": ("COMPLETED", ""), "bench": ("FAILED", "rmsnorm 12% slower")}
    with pytest.raises(RegressionError, match="bench: rmsnorm 12% slower"):
        releasing.check_gate(stages, allow_regressions=None)
    summary = releasing.check_gate(stages, allow_regressions="new tiling, accepted by perf review")
    assert "new tiling, accepted by perf review" in summary and "rmsnorm 12% slower" in summary


def _pages(store: LocalStore, prefix: str) -> dict[str, bytes]:
    return {k: store.get(k) for k in store.list(f"{prefix}/") if k.endswith(("index.html", "index.json"))}


def test_rollback_leaves_every_page_byte_identical(store, tmp_path):
    before = _pages(store, "release")
    saved = releasing.snapshot_pages(store, "release", tmp_path / "rollback")
    assert sorted(saved) == sorted(before)
    # What a publish that then failed verification leaves behind: changed
    # project and root pages, and a brand-new variant index.
    _publish(store, "release/cu130/simple", ["kiln_kernels-0.1.0+cu130-py3-none-any.whl",
                                             "kiln_kernels-0.2.0+cu130-py3-none-any.whl",
                                             "kiln_kernels-0.4.0+cu130-py3-none-any.whl",
                                             "other-1.0-py3-none-any.whl"])
    _publish(store, "release/rocm/simple", ["kiln_kernels-0.4.0+rocm-py3-none-any.whl"])
    assert _pages(store, "release") != before
    result = releasing.restore_pages(store, tmp_path / "rollback")
    after = _pages(store, "release")
    assert {k: after[k] for k in before} == before
    assert result["restored"] == sorted(["release/cu130/simple/index.html", "release/cu130/simple/index.json",
                                         "release/cu130/simple/kiln-kernels/index.html",
                                         "release/cu130/simple/kiln-kernels/index.json"])
    assert "release/rocm/simple/index.html" in result["new"]
    # A second rollback finds nothing left to change.
    assert releasing.restore_pages(store, tmp_path / "rollback")["restored"] == []
