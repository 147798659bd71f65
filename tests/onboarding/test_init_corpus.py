"""kiln init on a corpus of public kernel packages, as published: each sdist's kiln.toml, checked against the
package's own PKG-INFO (name, version, requires-python) and the facts pinned beside it (import package, kind,
variants, build switches). Static only: kiln init reads the sdist, nothing builds it. The `real_corpus` tier
(`pytest -m real_corpus`), also part of the default run, so CI's README test line runs it."""

from __future__ import annotations

import tomllib
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from kiln.tasks.onboarding import init_project
from tests.helpers.real_packages import download_sdist, load_pin, pinned_names

DEFAULT_REQUIRES_PYTHON = ">=3.10"  # what kiln init writes where a package declares none


def _pkg_info(sdist: Path) -> dict[str, str]:
    message = Parser().parsestr((sdist / "PKG-INFO").read_text(encoding="utf-8"), headersonly=True)
    return {k: str(v) for k, v in message.items()}


@pytest.mark.real_corpus
@pytest.mark.real_package
@pytest.mark.parametrize("name", pinned_names())
def test_kiln_init_infers_what_a_public_kernel_package_says_of_itself(name, tmp_path):
    pin = load_pin(name)
    sdist = download_sdist(pin, tmp_path)
    info = _pkg_info(sdist)
    result = init_project(sdist)
    written = tomllib.loads(result.text)
    project = written["project"]
    assert canonicalize_name(project["distribution"]) == canonicalize_name(info["Name"])
    assert project["package"] == pin.import_name and project["source"].split("/")[-1] == pin.import_name
    declared, base = Version(info["Version"]), Version(project["version"])
    assert Version(f"{base}.dev0") > declared and base.release[:2] == declared.release[:2]  # nightlies sort above
    requires = info.get("Requires-Python", DEFAULT_REQUIRES_PYTHON)
    assert SpecifierSet(project["requires_python"]) == SpecifierSet(requires)
    assert result.findings.kind == pin.kind
    assert [v["name"] for v in written["variants"]] == list(pin.variants), result.findings.reasons
    gpu = [v for v in written["variants"] if v["backend"] == "cuda"]
    assert (gpu[0].get("build_env", {}) if gpu else {}) == pin.build_env, result.findings.reasons
