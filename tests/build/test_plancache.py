"""The stored build plan: reused while its inputs are unchanged, replanned on any change, never stale."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from kiln.tasks.build import plancache, sparepool, stage
from kiln.tasks.build.plan import plan_build
from kiln.tasks.build.stage import prepare_build
from kiln.tasks.project.config import load_config
from kiln.tasks.project.registry import load_registry
from kiln.tasks.project.registry_guest import load_registry_data
from tests.helpers.projects import copy_project


class _Counting:
    """``load_registry_data`` that counts its calls: a replan reads the registry (in its guest), a reused plan
    does not."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return load_registry_data(*args, **kwargs)


@pytest.fixture
def project(tmp_path, monkeypatch):
    config = copy_project("tiny", tmp_path)
    counting = _Counting()
    monkeypatch.setattr(stage, "load_registry_data", counting)
    return config, tmp_path / "cache", counting


def _prepare(config: Path, cache: Path, variants=None):
    return prepare_build(str(config), "0.1.0", variants, cache_dir=str(cache))


def _entry(cache: Path) -> Path:
    (entry,) = (cache / "plans").glob("*.json")
    return entry


def _keys(setup) -> dict[str, str]:
    return {u.id: u.key for u in setup.plan.units}


def test_an_unchanged_project_reuses_the_stored_plan_without_importing_the_registry(project):
    config, cache, counting = project
    first = _prepare(config, cache)
    second = _prepare(config, cache)
    assert counting.calls == 1
    assert second.plan == first.plan
    assert second.stamp == first.stamp and second.nvcc == first.nvcc
    # The same plan the planner computes from the registry itself, field for field.
    cfg = load_config(config)
    assert second.plan == plan_build(cfg, load_registry(cfg), second.plan.toolchain)


def test_an_edited_kernel_source_replans_and_changes_only_that_kernels_keys(project):
    config, cache, counting = project
    before = _keys(_prepare(config, cache))
    scale = config.parent / "tinyk" / "scale.py"
    scale.write_text(scale.read_text() + "\n# edited\n")
    after = _keys(_prepare(config, cache))
    assert counting.calls == 2
    assert sorted(before) == sorted(after)
    changed = sorted(uid for uid in before if before[uid] != after[uid])
    assert changed == ["build/cu130/8.0/scale/fp32_b64"]


def test_a_new_file_in_the_package_replans(project):
    config, cache, counting = project
    _prepare(config, cache)
    (config.parent / "tinyk" / "helper.h").write_text("#define N 1\n")
    _prepare(config, cache)
    assert counting.calls == 2


def test_an_edited_kiln_toml_replans_with_its_new_archs(project):
    config, cache, counting = project
    _prepare(config, cache)
    config.write_text(config.read_text().replace('archs = ["8.0", "9.0"]', 'archs = ["8.0"]'))
    setup = _prepare(config, cache)
    assert counting.calls == 2
    assert not [u for u in setup.plan.units if u.arch == "9.0"]


def test_other_variants_are_stored_beside_and_do_not_evict_each_other(project):
    config, cache, counting = project
    _prepare(config, cache, ["rocm"])
    _prepare(config, cache)
    _prepare(config, cache, ["rocm"])
    _prepare(config, cache)
    assert counting.calls == 2
    assert len(list((cache / "plans").glob("*.json"))) == 2


def test_a_registry_helper_outside_the_package_is_an_input(project):
    config, cache, counting = project
    helper = config.parent / "tiny_plan_helper.py"
    helper.write_text("BLOCK = 64\n")
    registry = config.parent / "tinyk" / "registry.py"
    registry.write_text(registry.read_text().replace("from __future__ import annotations\n",
                                                     "from __future__ import annotations\n\nimport tiny_plan_helper  # noqa\n"))
    _prepare(config, cache)
    _prepare(config, cache)
    assert counting.calls == 1
    helper.write_text("BLOCK = 128\n")
    _prepare(config, cache)
    assert counting.calls == 2


def test_a_registry_read_ahead_of_its_plan_is_used_and_records_what_its_import_loaded(project, monkeypatch):
    # kiln nightly starts reading the registry in its guest while its server starts (head_start); the plan takes
    # that read, records the distributions its import loaded as its inputs, and nothing of it is imported here.
    config, cache, counting = project
    for name in [n for n in sys.modules if n.partition(".")[0] in ("text_unidecode", "tinyk")]:
        monkeypatch.delitem(sys.modules, name)  # another test's in-process import of them: not this one's
    registry = config.parent / "tinyk" / "registry.py"
    registry.write_text(registry.read_text().replace("from __future__ import annotations\n",
                                                     "from __future__ import annotations\n\nimport text_unidecode  # noqa\n"))
    try:
        stage.head_start(load_config(config))
    finally:
        sparepool.discard()  # the compile workers it also started: not this test's subject
    _prepare(config, cache)
    assert counting.calls == 1  # the head start's read, taken by the plan
    assert "text-unidecode" in json.loads(_entry(cache).read_text())["inputs"]["dists"]
    assert "text_unidecode" not in sys.modules and "tinyk" not in sys.modules


def test_a_changed_toolchain_replans(project, monkeypatch):
    config, cache, counting = project
    _prepare(config, cache)
    monkeypatch.setattr(stage, "toolchain_versions", lambda: {"triton": "9.9.9", "torch": "9.9.9"})
    setup = _prepare(config, cache)
    assert counting.calls == 2
    assert setup.plan.toolchain["triton"] == "9.9.9"


def test_a_distribution_upgraded_since_planning_replans(project):
    config, cache, counting = project
    _prepare(config, cache)
    entry = _entry(cache)
    data = json.loads(entry.read_text())
    data["inputs"]["dists"]["packaging"] = "0.0.1"  # what the entry saw then: another version than installed now
    entry.write_text(json.dumps(data))
    _prepare(config, cache)
    assert counting.calls == 2
    assert json.loads(entry.read_text())["inputs"]["dists"].get("packaging") != "0.0.1"


@pytest.mark.parametrize("damage", [
    lambda text: text[: len(text) // 2],  # truncated
    lambda text: "not json",
    lambda text: json.dumps({"format": plancache.PLAN_FORMAT}),  # fields missing
    lambda text: text.replace('"units": [', '"units": [{"id": 1}, '),  # a unit of the wrong shape
])
def test_a_corrupt_entry_is_a_warning_and_a_replan(project, caplog, damage):
    config, cache, counting = project
    first = _prepare(config, cache)
    entry = _entry(cache)
    entry.write_text(damage(entry.read_text()))
    with caplog.at_level(logging.WARNING, logger="kiln.tasks.build.plancache"):
        again = _prepare(config, cache)
    assert counting.calls == 2
    assert again.plan == first.plan
    assert any("unreadable" in r.getMessage() and str(entry) in r.getMessage() for r in caplog.records)
    _prepare(config, cache)  # rewritten whole: reused again
    assert counting.calls == 2


def test_an_entry_of_another_format_is_not_used(project, caplog):
    config, cache, counting = project
    _prepare(config, cache)
    entry = _entry(cache)
    entry.write_text(entry.read_text().replace(plancache.PLAN_FORMAT, "kiln-plan-0"))
    _prepare(config, cache)
    assert counting.calls == 2


def test_a_read_only_cache_still_builds(project, monkeypatch, caplog):
    config, cache, counting = project

    def refuse(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(plancache, "atomic_write_text", refuse)
    with caplog.at_level(logging.WARNING, logger="kiln.tasks.build.plancache"):
        setup = _prepare(config, cache)
    assert setup.plan.units and "could not store the build plan" in caplog.text
