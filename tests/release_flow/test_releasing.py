"""The release's decisions without Prefect: version checks, the gate (baselines, advisory CPU timings), rollback."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from packaging.version import Version

from kiln.core.dists import make_distribution
from kiln.core.errors import ConfigError, InvalidInputError
from kiln.core.store import LocalStore
from kiln.release.index.render import generate
from kiln.tasks import releasing
from kiln.tasks.bench.compare import compare_results, comparison_record
from kiln.tasks.project.config import load_config
from tests.helpers.benchfakes import FakeTimer, fake_run

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
        releasing.check_release_version(version, "release", published)
    assert needle in str(info.value)


def test_check_version_normalises_an_acceptable_version(store):
    published = releasing.published_versions(store, "release", "kiln-kernels")
    assert releasing.check_release_version("0.3.0-rc.1", "release", published) == "0.3.0rc1"
    assert releasing.check_release_version("0.0.1", "release", []) == "0.0.1"


def test_unknown_channel_is_refused_with_the_known_ones():
    config = load_config(REPO / "kiln.toml")
    assert releasing.channel_prefix(config, "nightly") == "nightly"
    with pytest.raises(ConfigError, match=r"unknown channel 'beta'.*\['nightly', 'release'\]"):
        releasing.channel_prefix(config, "beta")


def test_gate_stops_on_failed_tests_even_with_an_override():
    stages = {"build": ("COMPLETED", ""), "test": ("FAILED", "test: 1 of 9 units failed"), "bench": ("COMPLETED", "")}
    decision = releasing.gate_decision(stages, None, allow_regressions="known slowdown")
    assert not decision.passed
    assert decision.lines[0] == "release stopped before publishing — test: test: 1 of 9 units failed"


def _comparison(blocking: tuple[str, ...] | None, *, fail_on_regression: bool = True, baseline=True):
    """What a bench stage records when a CPU run is 50% slower than the last published release."""
    current = fake_run(FakeTimer(kernel=1.5e-3, seed=2), "now")
    base = fake_run(FakeTimer(seed=1), "release-0.1.0") if baseline else None
    comparison = compare_results(base, current, 0.05, "no release published on the release channel with cpu "
                                                      "results measured on cpu yet: nothing to compare against")
    return comparison_record(comparison, fail_on_regression, blocking)


def test_a_noisy_cpu_run_with_no_published_release_passes_and_says_so():
    stages = {"build": ("COMPLETED", ""), "test": ("COMPLETED", ""), "bench": ("COMPLETED", "")}
    decision = releasing.gate_decision(stages, _comparison(("graph_replay",), baseline=False), None)
    assert decision.passed
    assert decision.lines[0] == ("benchmarks: no release published on the release channel with cpu results measured "
                                 "on cpu yet: nothing to compare against; the gate passes on build and tests")


def test_a_bench_stage_that_compared_nothing_says_why_in_the_gate():
    stages = {"build": ("COMPLETED", ""), "test": ("COMPLETED", ""), "bench": ("COMPLETED", "")}
    why = "not run: no kernel declares bench cases (the registry 'pkg.registry:registry'): nothing to measure"
    decision = releasing.gate_decision(stages, None, None, why)
    assert decision.passed and decision.lines[0] == f"benchmarks: not compared: {why}"
    assert releasing.gate_decision(stages, None, None).lines[0] == "benchmarks were not compared"


def test_cpu_regressions_are_advisory_by_default_and_listed_with_ratio_and_noise():
    stages = {"build": ("COMPLETED", ""), "test": ("COMPLETED", ""), "bench": ("COMPLETED", "")}
    decision = releasing.gate_decision(stages, _comparison(("graph_replay",)), None)
    assert decision.passed
    assert decision.lines[0].startswith("benchmarks compared with the last published release (run release-0.1.0, "
                                        "3 cases, threshold 5%)")
    assert decision.lines[1].startswith("advisory regressions (3; only ['graph_replay'] timings block")
    cases = decision.lines[2:5]
    assert [c.split()[0] for c in cases] == ["axpy/n1024", "axpy/n4096", "rownorm/m8_n128"]
    # The ratio before and after, the change, the noise and the threshold, for each case.
    assert all(re.fullmatch(r"\S+ \[cpu\] kernel/reference 0\.\d{3} → 0\.\d{3} \(\+\d+\.\d%; noise ±\d+\.\d%, "
                            r"threshold 5%\)", c.strip()) for c in cases), cases


def test_kiln_toml_can_make_cpu_regressions_block_and_a_reason_overrides_them():
    stages = {"build": ("COMPLETED", ""), "test": ("COMPLETED", ""),
              "bench": ("FAILED", "Benchmarks: 2 of 2 units failed — bench/axpy: regression: …")}
    blocked = releasing.gate_decision(stages, _comparison(("graph_replay", "cpu")), None)
    assert not blocked.passed
    assert blocked.lines[0].startswith("release stopped before publishing — bench: Benchmarks: 2 of 2 units failed")
    assert "blocking regressions (3):" in blocked.lines
    assert blocked.lines[-1] == "to publish anyway, give the reason: kiln release --allow-regressions REASON"
    # With a reason the bench runs with regressions as warnings; the gate records why it went on.
    allowed = releasing.gate_decision({**stages, "bench": ("COMPLETED", "")},
                                      _comparison(("graph_replay", "cpu"), fail_on_regression=False),
                                      "new tiling, accepted by perf review")
    assert allowed.passed
    assert "published despite benchmark regressions, because: new tiling, accepted by perf review" in allowed.lines
    assert sum("kernel/reference" in line for line in allowed.lines) == 3


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


def test_the_state_names_the_gate_reads_are_prefects_own():
    from typing import get_args

    from prefect.client.schemas.objects import StateType

    assert set(get_args(releasing.StateName)) == {s.value for s in StateType}


def test_a_published_version_is_resumed_only_from_the_commit_its_release_run_built(store):
    published = releasing.published_versions(store, "release", "kiln-kernels")
    asked: list[str] = []

    def origins() -> list[str]:
        asked.append("asked")
        return ["a" * 40]

    assert releasing.check_release_version("0.2.0", "release", published, "a" * 40, origins) == "0.2.0"
    with pytest.raises(InvalidInputError, match=f"from commit {'a' * 12}, not this checkout's {'b' * 12}"):
        releasing.check_release_version("0.2.0", "release", published, "b" * 40, origins)
    with pytest.raises(InvalidInputError, match="no release run of it in the artifact store"):
        releasing.check_release_version("0.2.0", "release", published, "a" * 40, lambda: [])
    with pytest.raises(InvalidInputError, match="uncommitted changes"):  # a dirty tree resumes nothing
        releasing.check_release_version("0.2.0", "release", published, "", origins)
    assert releasing.check_release_version("0.3.0", "release", published, "a" * 40, origins) == "0.3.0"
    assert len(asked) == 2  # the store's runs are read only for a version already published from a clean tree
