"""The results file: round trip, validation with clear errors, run metadata."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kiln.core.errors import InvalidInputError
from kiln.tasks.bench.results import git_commit, hardware, load_results, save_results
from tests.helpers.benchfakes import FakeTimer, fake_run


@pytest.fixture
def results_file(tmp_path: Path) -> Path:
    return save_results(fake_run(FakeTimer(seed=1)), tmp_path / "results.json")


def test_results_round_trip_through_the_file_unchanged(results_file: Path):
    loaded = load_results(results_file)
    assert loaded == fake_run(FakeTimer(seed=1))
    data = json.loads(results_file.read_text())
    assert data["schema_version"] == 1
    case = data["cases"][0]
    assert {"kernel", "name", "shape", "dtype", "metric", "stats", "reference"} <= set(case)
    assert {"samples", "median", "spread", "ci_low", "ci_high"} <= set(case["stats"])
    assert {"device", "driver", "cpu"} == set(data["hardware"])


def test_derived_rates_are_written_and_recomputed_from_the_samples_on_load(results_file: Path):
    written = json.loads(results_file.read_text())["cases"][0]
    assert written["gbps"] == pytest.approx(4096 / written["stats"]["median"] / 1e9)
    assert written["tflops"] is None  # no FLOPs declared
    assert written["speedup"] == pytest.approx(written["reference"]["median"] / written["stats"]["median"])
    _edit(results_file, lambda d: d["cases"][0].update(speedup=100.0, gbps=1e6))
    case = load_results(results_file).cases[0]
    assert case.speedup == pytest.approx(written["speedup"]) and case.gbps == pytest.approx(written["gbps"])


def _edit(path: Path, change) -> Path:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(schema_version=7), "schema_version 7"),
        (lambda d: d.pop("commit"), "commit"),
        (lambda d: d["cases"][0].update(metric="wallclock"), r"cases\.0\.metric"),
        (lambda d: d["cases"][0]["stats"].update(samples=[]), r"cases\.0\.stats\.samples"),
        (lambda d: d["cases"][0]["stats"].update(median=1.0), "outside its interval"),
        (lambda d: d["cases"][0]["stats"].update(samples=[-1.0]), "positive"),
        (lambda d: d["cases"].append(d["cases"][0]), "duplicate cases"),
        (lambda d: d.update(surprise=1), "surprise"),
    ],
)
def test_invalid_results_are_refused_naming_the_file_and_field(results_file: Path, change, message):
    _edit(results_file, change)
    with pytest.raises(InvalidInputError, match=message) as info:
        load_results(results_file)
    assert str(results_file) in str(info.value)


def test_a_file_that_is_not_json_or_missing_is_refused_clearly(tmp_path: Path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidInputError, match="not valid JSON"):
        load_results(bad)
    with pytest.raises(InvalidInputError, match="does not exist"):
        load_results(tmp_path / "absent.json")


def test_commit_is_the_checked_out_head_inside_git(repo_root: Path):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_root, capture_output=True, text=True,
                          timeout=10, check=True).stdout.strip()
    assert git_commit(repo_root) == head


def test_commit_is_unknown_outside_git(tmp_path: Path):
    assert git_commit(tmp_path) == "unknown"


def test_commit_is_unknown_when_git_hangs(tmp_path: Path):
    def hanging(argv, **kwargs):  # fault injection: git never answers
        raise subprocess.TimeoutExpired(argv, kwargs["timeout"])

    assert git_commit(tmp_path, run=hanging, timeout=0.1) == "unknown"


def test_cpu_hardware_names_the_cpu_model():
    info = hardware("cpu")
    assert info.device == "cpu" and info.driver == "none" and info.cpu and info.cpu != "unknown"
