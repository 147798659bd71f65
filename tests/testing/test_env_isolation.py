"""Test environments share nothing writable: copies from uv's cache, a base checked by hash, an owner-only cache.

Real environments (uv, pip) and real suites through Kiln's worker; no mocks.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from kiln.core.errors import UnsafePathError
from kiln.tasks.build.buildenv import owner_only_dir
from kiln.tasks.testing import envs
from kiln.tasks.testing.baseenv import BASES, CACHE_ENV, base_env, changed_files, manifest_path, site_packages
from kiln.tasks.testing.jobs import RunOptions
from kiln.tasks.testing.runner import run_tests
from tests.helpers.wheelkit import make_wheel

EDITS_ITS_DEPENDENCY = """
import os

import shared_dep


def test_edit_the_installed_dependency_in_place():
    with open(shared_dep.__file__, "a") as handle:  # an in-place edit, as a careless test or a patching tool does
        handle.write("\\nPAYLOAD = 'edited by suite a'\\n")
    assert os.stat(shared_dep.__file__).st_nlink == 1  # no other name shares these bytes: not uv's cache's
"""

READS_ITS_DEPENDENCY = """
import shared_dep


def test_the_dependency_is_as_installed():
    assert shared_dep.PAYLOAD == "pristine"
"""


def _suite(root: Path, test: str, env: envs.TestEnv) -> list[tuple[str, str, str]]:
    (root / "tests").mkdir(parents=True)
    (root / "tests" / "test_it.py").write_text(test)
    results = run_tests(["tests"], root, root / "work", RunOptions(python=str(env.python), preload=(), gpus=0,
                                                                   retries=0))
    return [(r.nodeid, r.outcome, r.details[-1500:]) for r in results]


@pytest.mark.slow
def test_an_in_place_edit_by_one_suite_never_reaches_another_suite(tmp_path):
    # Two packages of one machine require the same dependency wheel: uv installs it from its cache into both.
    dep = make_wheel(tmp_path / "wheels", "shared-dep", "1.0", payload="pristine")
    first = make_wheel(tmp_path / "wheels", "pkg-a", "1.0", requires=["shared-dep"])
    second = make_wheel(tmp_path / "wheels", "pkg-b", "1.0", requires=["shared-dep"])
    env_a = envs.make_env(tmp_path / "a" / "env", [first, dep], tests_root=tmp_path / "a")
    env_b = envs.make_env(tmp_path / "b" / "env", [second, dep], tests_root=tmp_path / "b")

    [(_, edited, details)] = _suite(tmp_path / "a", EDITS_ITS_DEPENDENCY, env_a)
    assert edited == "passed", details
    [(_, outcome, details)] = _suite(tmp_path / "b", READS_ITS_DEPENDENCY, env_b)
    assert outcome == "passed", details
    env_c = envs.make_env(tmp_path / "c" / "env", [second, dep], tests_root=tmp_path / "c")  # made after the edit
    [(_, outcome, details)] = _suite(tmp_path / "c", READS_ITS_DEPENDENCY, env_c)
    assert outcome == "passed", details


@pytest.mark.slow
def test_nothing_of_kilns_harness_in_an_environment_is_kilns_own_file(tmp_path):
    wheel = make_wheel(tmp_path / "wheels", "probe-pkg", "1.0", module="probe_pkg")
    env = envs.make_env(tmp_path / "env", [wheel])

    harness = env.root / "kiln-harness" / "kiln"
    modules = list(harness.rglob("*.py"))
    assert modules and not [m for m in harness.rglob("*") if m.is_symlink()]
    assert (harness / "tasks" / "testing" / "pytest_server.py").is_file()


@pytest.mark.slow
def test_a_base_changed_after_it_was_made_is_detected_named_and_made_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    wheel = make_wheel(tmp_path / "wheels", "kilntinydep", "1.0", payload="pristine")
    pins = [f"kilntinydep @ {wheel.as_uri()}"]
    base = base_env(pins)
    module = base.site / "kilntinydep" / "__init__.py"
    assert not os.stat(module).st_mode & 0o222 and not os.stat(module.parent).st_mode & 0o222  # read-only
    assert changed_files(base.root) == []
    os.chmod(module.parent, 0o755)  # what a test running as the owner (or root) can do
    os.chmod(module, 0o644)
    original = module.read_text()
    module.write_text(original.replace("pristine", "edited!!"))  # same size
    (base.site / "planted.pth").write_text("import os\n")
    # the list a test could rewrite used to live in the base: a forged one there vouches for nothing now
    os.chmod(base.root, 0o755)
    (base.root / "kiln-base-files.json").write_text(json.dumps({str(module.relative_to(base.root)): ["forged"]}))
    assert manifest_path(base.root).parent != base.root and not manifest_path(base.root).is_relative_to(base.root)
    assert changed_files(base.root) == sorted([str(module.relative_to(base.root)), "kiln-base-files.json",
                                               str((base.site / "planted.pth").relative_to(base.root))])

    with caplog.at_level(logging.WARNING, logger="kiln.tasks.testing.baseenv"):
        again = base_env(pins)

    assert again.root == base.root and changed_files(again.root) == []
    assert module.read_text() == original and not (again.site / "planted.pth").exists()
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert str(base.root) in warned and "kilntinydep/__init__.py" in warned and "planted.pth" in warned
    assert sorted(p.name for p in (tmp_path / "cache" / BASES).iterdir()) == [base.root.name, f"{base.root.name}.lock"]
    assert site_packages(again.root) == again.site and manifest_path(again.root).is_file()


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_an_env_cache_others_can_write_is_refused_naming_it(tmp_path, monkeypatch, mode):
    cache = tmp_path / "shared-cache"
    cache.mkdir()
    cache.chmod(mode)
    monkeypatch.setenv(CACHE_ENV, str(cache))
    wheel = make_wheel(tmp_path / "wheels", "probe-pkg", "1.0", module="probe_pkg")

    with pytest.raises(UnsafePathError, match="not owner-only") as caught:
        envs.make_env(tmp_path / "env", [wheel])

    assert str(cache) in str(caught.value)
    assert list(cache.iterdir()) == [] and not (tmp_path / "env").exists()  # nothing made, nothing run


def test_an_env_cache_another_user_owns_is_refused(tmp_path):
    cache = tmp_path / "theirs"
    cache.mkdir(mode=0o700)
    try:
        os.chown(cache, 65534, 65534)  # nobody
    except PermissionError:
        pytest.skip("only root can give a directory to another user")
    with pytest.raises(UnsafePathError, match="another user") as caught:
        owner_only_dir(cache)
    assert str(cache) in str(caught.value)


def test_a_missing_env_cache_is_made_owner_only(tmp_path):
    made = owner_only_dir(tmp_path / "new" / "cache")
    assert made.is_dir() and made.stat().st_mode & 0o777 == 0o700
