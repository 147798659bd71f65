"""A suite's environment holds the wheel, what it declares, pytest and the suite's ``requires``: nothing of Kiln's.

Real environments (uv, pip, the shared base of ``$KILN_TEST_ENV_CACHE``, which
tests/conftest.py points at one directory per user) and real test runs
through Kiln's worker; no mocks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.core.sandbox import support
from kiln.tasks.testing import envs
from kiln.tasks.testing.baseenv import BASES, CACHE_ENV
from kiln.tasks.testing.classify import suite_state
from kiln.tasks.testing.jobs import RunOptions
from kiln.tasks.testing.runner import run_tests
from tests.helpers.sdists import evil_sdist_index, probing_sdist_index
from tests.helpers.wheelkit import make_wheel

pytestmark = pytest.mark.slow

# A small pure-Python tool from PyPI that Kiln's own environment does not have.
TOOL = "inflection==0.5.1"

LEAKY_BODY = """
def newest(versions):
    import packaging.version  # not in the wheel's Requires-Dist: pytest's dependency, not the package's
    return max(versions, key=packaging.version.Version)
"""

LEAKY_TEST = """
import packaging.version  # a test file may: pytest declares packaging

import leaky_pkg


def test_newest():
    assert packaging.version.Version("1.10") > packaging.version.Version("1.9")
    assert leaky_pkg.newest(["1.9", "1.10"]) == "1.10"
"""


def _project(root: Path, name: str, text: str) -> Path:
    (root / "tests").mkdir(parents=True)
    (root / "tests" / f"test_{name}.py").write_text(text)
    return root


def _run(env: envs.TestEnv, project: Path, work: Path):
    return run_tests(["tests"], project, work, RunOptions(python=str(env.python), preload=(), gpus=0, retries=0))


def _outcomes(results) -> list[tuple[str, str]]:
    return [(r.nodeid, r.outcome) for r in results]


def test_an_import_the_wheel_does_not_declare_fails_its_suite_with_the_missing_name(tmp_path):
    # pytest (in the shared base) depends on packaging, and the test file imports it first, so it is in
    # sys.modules when the package's own lazy import runs: the guard must still refuse it there.
    project = _project(tmp_path / "project", "leaky", LEAKY_TEST)
    wheel = make_wheel(tmp_path / "wheels", "leaky-pkg", "1.0", module="leaky_pkg", body=LEAKY_BODY)
    env = envs.make_env(tmp_path / "env", [wheel], tests_root=project)

    results = _run(env, project, tmp_path / "work")

    assert suite_state(results) == "failed"
    assert _outcomes(results) == [("tests/test_leaky.py::test_newest", "error")]  # an exception, not an assert
    message = results[0].message
    assert "No module named 'packaging'" in message and "leaky_pkg-1.0-py3-none-any.whl" in message, message
    assert "does not declare" in message and "leaky_pkg/__init__.py" in results[0].details


def test_the_same_import_passes_once_the_wheel_declares_it(tmp_path):
    project = _project(tmp_path / "project", "leaky", LEAKY_TEST)
    wheel = make_wheel(tmp_path / "wheels", "leaky-pkg", "1.0", module="leaky_pkg", body=LEAKY_BODY,
                       requires=["packaging>=20"])
    env = envs.make_env(tmp_path / "env", [wheel], tests_root=project)

    results = _run(env, project, tmp_path / "work")

    assert _outcomes(results) == [("tests/test_leaky.py::test_newest", "passed")], results[0].details


def test_kiln_runtime_is_held_to_the_rules_while_kilns_harness_is_not(tmp_path):
    # kiln.runtime is the kiln-runtime wheel's (installed for Kiln's harness); the package must declare it.
    project = _project(tmp_path / "project", "spec", "import spec_pkg\n\n\ndef test_spec():\n    spec_pkg.spec()\n")
    wheel = make_wheel(tmp_path / "wheels", "spec-pkg", "1.0", module="spec_pkg",
                       body="def spec():\n    import kiln.runtime.spec\n    return kiln.runtime.spec\n")
    env = envs.make_env(tmp_path / "env", [wheel], tests_root=project)

    results = _run(env, project, tmp_path / "work")  # Kiln's worker itself imports kiln.* freely

    assert _outcomes(results) == [("tests/test_spec.py::test_spec", "error")]
    assert "No module named 'kiln.runtime'" in results[0].message and "(kiln-runtime)" in results[0].message


def test_nothing_of_kilns_own_site_packages_is_importable(tmp_path):
    wheel = make_wheel(tmp_path / "wheels", "probe-pkg", "1.0", module="probe_pkg")
    env = envs.make_env(tmp_path / "env", [wheel])
    assert importlib.util.find_spec("prefect") is not None  # Kiln has it: it would leak through a shared path

    probe = subprocess.run(
        [str(env.python), "-P", "-c",
         "import importlib.util as u, json; print(json.dumps([n for n in ('prefect', 'boto3', 'matplotlib', "
         "'probe_pkg', 'torch', 'pytest', 'kiln.tasks.testing.pytest_server') if u.find_spec(n) is None]))"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)

    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == '["prefect", "boto3", "matplotlib"]'


@pytest.mark.real_package
def test_a_suites_requires_is_installed_and_its_tests_run(tmp_path):
    assert importlib.util.find_spec("inflection") is None, "the tool must be one Kiln's environment lacks"
    project = _project(tmp_path / "project", "tool", (
        "import inflection\n\nimport tool_user\n\n\n"
        "def test_tool():\n    assert inflection.camelize('kiln_suite') == 'KilnSuite'\n"
        "    assert tool_user.PAYLOAD == 'mine'\n"))
    wheel = make_wheel(tmp_path / "wheels", "tool-user", "1.0", module="tool_user", payload="mine")
    env = envs.make_env(tmp_path / "env", [wheel], [TOOL], tests_root=project)

    results = _run(env, project, tmp_path / "work")

    assert _outcomes(results) == [("tests/test_tool.py::test_tool", "passed")], results[0].details


def test_a_suites_sdist_dependency_builds_without_the_steps_secrets(tmp_path, monkeypatch):
    """A suite's requirement from an extra index that is only an sdist: uv runs its build hook, someone else's
    code, and that hook sees no cloud credential, no Prefect API key and not the user's home."""
    markers = tmp_path / "markers"
    evil = evil_sdist_index(tmp_path / "evil", markers)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "step-secret")
    monkeypatch.setenv("PREFECT_API_KEY", "prefect-secret")
    wheel = make_wheel(tmp_path / "wheels", "sdist-user", "1.0", module="sdist_user")
    with pytest.raises(envs.DependencyResolutionError, match="evil-sdist"):
        envs.make_env(tmp_path / "env", [wheel], ["evil-sdist"], indexes=[evil])  # its backend builds nothing
    seen = [json.loads(p.read_text()) for p in markers.iterdir()] if markers.exists() else []
    if support().landlock_abi and support().namespaces:
        # sandboxed, the hook (which ran: the test below) cannot even write its marker outside
        assert not seen, seen
    else:
        assert seen, "the premise: uv ran the sdist's build hook"
    for environ in seen:
        assert "AWS_SECRET_ACCESS_KEY" not in environ and "PREFECT_API_KEY" not in environ, sorted(environ)
        assert environ.get("HOME") != str(Path.home())


@pytest.mark.skipif(not (support().landlock_abi and support().namespaces),
                    reason="needs Landlock and user namespaces (the sandbox the installer runs in)")
def test_a_suites_dependency_an_index_holds_only_as_an_sdist_is_refused_and_its_hook_never_runs(tmp_path, monkeypatch):
    """uv installs a suite's requirements as a guest with the machine's network, taking only wheels: an sdist's
    build hook, someone else's code, never runs there; the refusal names the requirement and the way out."""
    secret, outside = tmp_path / "home" / ".netrc", tmp_path / "home" / "planted.txt"
    secret.parent.mkdir()
    secret.write_text("machine pypi.org password hunter2")
    cache = tmp_path / "uv-cache"
    monkeypatch.setenv("UV_CACHE_DIR", str(cache))
    index = probing_sdist_index(tmp_path / "probe", secret, outside)
    wheel = make_wheel(tmp_path / "wheels", "probe-user", "1.0", module="probe_user")
    with pytest.raises(envs.DependencyResolutionError, match="probe-sdist") as refused:
        envs.make_env(tmp_path / "env", [wheel], ["probe-sdist"], indexes=[index])
    message = str(refused.value)
    assert "has no usable wheels" in message and "only wheels from an index" in message and "find-links" in message
    assert not list(cache.glob("probe-*.json")) and not outside.exists()  # the hook never ran


def credential_names(environ: dict[str, str]) -> list[str]:
    from kiln.core.sandbox import credential_name

    return [name for name in environ if credential_name(name)]


def _base_of(env: envs.TestEnv) -> Path:
    site = next((env.root / "lib").glob("python*/site-packages"))
    return Path((site / "zz_kiln_base.pth").read_text().strip())


def test_two_suites_of_one_variant_share_one_base_environment(tmp_path):
    wheels = [make_wheel(tmp_path / "wheels", f"pkg-{n}", "1.0") for n in ("a", "b")]
    first = envs.make_env(tmp_path / "a", [wheels[0]])
    second = envs.make_env(tmp_path / "b", [wheels[1]])

    assert _base_of(first) == _base_of(second)
    assert _base_of(first).stat().st_ino == _base_of(second).stat().st_ino
    assert _base_of(first).is_relative_to(Path(os.environ[CACHE_ENV]))


@pytest.mark.real_package
def test_concurrent_creation_of_one_base_makes_it_once(tmp_path):
    # Three processes ask for the same (small) base at once, in an empty cache: one makes it, all get it.
    script = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
              "from kiln.tasks.testing.baseenv import base_env\n"
              f"print(base_env([{TOOL!r}]).root)\n")
    env = {**os.environ, CACHE_ENV: str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-P", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]

    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in outs]
    roots = {out.strip() for out, _ in outs}
    assert len(roots) == 1
    made = [name for name in os.listdir(tmp_path / "cache" / BASES) if not name.endswith(".lock")]
    assert made == [Path(roots.pop()).name]  # no second copy, no temporary directory left
    assert sum("created the build environment" in err for _, err in outs) == 1


@pytest.mark.skipif(not (support().landlock_abi and support().namespaces),
                    reason="needs Landlock and user namespaces (the sandbox the installer runs in)")
def test_the_sandboxed_installer_starts_in_its_home_not_in_the_callers_checkout(tmp_path, monkeypatch):
    """uv reads its working directory for a configuration file: started in a checkout the guest may not read
    (``kiln nightly`` runs in one), it failed with 'failed to open file pyproject.toml: Permission denied'."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "pyproject.toml").write_text('[tool.uv]\nindex-url = "http://127.0.0.1:9/never"\n')
    monkeypatch.chdir(checkout)
    wheel = make_wheel(tmp_path / "wheels", "cwd-user", "1.0", module="cwd_user")
    env = envs.make_env(tmp_path / "env", [wheel])
    assert (next((env.root / "lib").glob("python*/site-packages")) / "cwd_user").exists()
