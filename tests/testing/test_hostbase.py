"""The test base copied from Kiln's interpreter (issue 46, part 5): exactly the base's distributions, else pip.

The real base (torch, Triton, numpy, pytest, pydantic) is the one the other runner tests use, in the
session's shared ``$KILN_TEST_ENV_CACHE``: made once for all of them, so this file adds no base of its own.
"""

from __future__ import annotations

import json
import logging
import subprocess
from importlib import metadata
from pathlib import Path

import pytest

from kiln.tasks.testing import baseenv
from kiln.tasks.testing.baseenv import (
    BASES,
    CACHE_ENV,
    base_env,
    base_pins,
    changed_files,
    manifest_path,
    prepare_bases,
)
from kiln.tasks.testing.hostbase import copy_into, host_distributions


def _dist(site: Path, name: str, version: str, requires: tuple[str, ...] = (), extra_files: tuple[str, ...] = (),
          direct_url: dict[str, object] | None = None) -> None:
    """A fake installed distribution in ``site``: a package, its dist-info and a RECORD naming them."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires))
    (site / name).mkdir()
    (site / name / "__init__.py").write_text(f"NAME = {name!r}\n")
    files = [f"{name}/__init__.py", f"{info.name}/METADATA", f"{info.name}/RECORD", *extra_files]
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url))
        files.append(f"{info.name}/direct_url.json")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))


@pytest.fixture
def site(tmp_path: Path) -> Path:
    site = tmp_path / "host" / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    _dist(site, "alpha", "1.0+cpu", requires=("beta>=2", 'gamma; extra == "docs"', 'delta; python_version < "3"'),
          extra_files=("../../../bin/alpha",))
    _dist(site, "beta", "2.1")
    _dist(site, "gamma", "1.0")  # only an extra of alpha's wants it
    _dist(site, "unrelated", "3.0")  # Kiln's own dependencies, Prefect and the like
    (site / "unrelated.pth").write_text("import unrelated\n")
    return site


def test_the_base_holds_the_pinned_distributions_and_their_closure_and_nothing_else(site, tmp_path):
    host = host_distributions(["alpha==1.0+cpu"], site)

    assert host is not None and host.pins == ("alpha==1.0+cpu", "beta==2.1")
    target = tmp_path / "base"
    target.mkdir()
    copy_into(target, host)
    copied = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert copied == sorted(["alpha/__init__.py", "alpha-1.0+cpu.dist-info/METADATA", "alpha-1.0+cpu.dist-info/RECORD",
                             "beta/__init__.py", "beta-2.1.dist-info/METADATA", "beta-2.1.dist-info/RECORD"])
    assert (target / "alpha" / "__init__.py").stat().st_mtime_ns == (site / "alpha" / "__init__.py").stat().st_mtime_ns
    assert (target / "beta" / "__init__.py").stat().st_ino != (site / "beta" / "__init__.py").stat().st_ino


@pytest.mark.parametrize("pins, why", [
    (["alpha==1.0"], "1.0 is not 1.0+cpu: another build (a CUDA torch is not the CPU one)"),
    (["alpha==2.0+cpu"], "another version"),
    (["alpha>=1.0"], "not an exact pin"),
    (["missing==1.0"], "not installed here"),
])
def test_a_pin_kilns_interpreter_does_not_have_exactly_leaves_the_base_to_pip(site, pins, why):
    assert host_distributions(pins, site) is None, why


def test_an_unmet_or_editable_or_incomplete_dependency_leaves_the_base_to_pip(site):
    _dist(site, "needsnewer", "1.0", requires=("beta>=3",))
    _dist(site, "needsmissing", "1.0", requires=("nowhere",))
    _dist(site, "editable", "1.0", direct_url={"url": "file:///src", "dir_info": {"editable": True}})
    _dist(site, "broken", "1.0")
    (site / "broken" / "__init__.py").unlink()  # its RECORD lists a file that is not there

    for name in ("needsnewer", "needsmissing", "editable", "broken"):
        assert host_distributions([f"{name}==1.0"], site) is None, name


@pytest.mark.slow
def test_the_real_base_copied_from_kilns_interpreter_imports_its_distributions_and_nothing_else():
    host = host_distributions(base_pins())
    assert host is not None, "Kiln's test interpreter has torch, Triton, numpy, pytest and pydantic installed"

    base = base_env(base_pins())  # the session's shared base: made once, copied, for every runner test

    assert sorted(base.pins) == sorted(host.pins) and changed_files(base.root) == []
    held = sorted(f"{d.metadata['Name'].lower().replace('_', '-')}=={d.version}"
                  for d in metadata.distributions(path=[str(base.site)]))
    assert held == sorted(p.lower() for p in host.pins)
    script = ("import importlib.util, json; print(json.dumps({n: importlib.util.find_spec(n) is not None for n in "
              "('torch', 'triton', 'numpy', 'pytest', 'pydantic', 'prefect', 'kiln', 'boto3', 'uv')}))")
    done = subprocess.run([str(base.root / "bin" / "python"), "-I", "-c", script], capture_output=True, text=True,
                          timeout=120, check=True)
    assert json.loads(done.stdout) == {"torch": True, "triton": True, "numpy": True, "pytest": True,
                                       "pydantic": True, "prefect": False, "kiln": False, "boto3": False, "uv": False}
    assert not (base.site / "kiln").exists() and not list(base.site.glob("__editable__*"))
    assert (base.site / "torch" / "__init__.py").stat().st_mode & 0o222 == 0 and manifest_path(base.root).is_file()
    # copies: Kiln's own torch is left as it was (a hard link would have shared the read-only mode)
    assert (host.site / "torch" / "__init__.py").stat().st_mode & 0o200


def test_a_base_pip_would_make_is_not_prepared_during_the_build(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))

    prepare_bases([("cuda", ("torch==0.0.1",))]).join(timeout=120)

    assert not (tmp_path / "cache" / BASES).exists() or not list((tmp_path / "cache" / BASES).iterdir())


@pytest.mark.slow
def test_the_bases_prepared_during_the_build_are_the_ones_the_suites_then_find(caplog, monkeypatch):
    monkeypatch.setattr(baseenv, "_preparing", set())  # what an in-process nightly before this test started
    with caplog.at_level(logging.INFO, logger="kiln.tasks.testing.baseenv"):
        first = prepare_bases([("cpu", ()), ("cuda", ())])  # one base: a GPU variant without a torch pin
        # asked again by the same process (kiln nightly while its server starts, then its flow): not again
        again = prepare_bases([("cpu", ())])
        first.join(timeout=600)
        again.join(timeout=600)

    prepared = [r.getMessage() for r in caplog.records if r.threadName == "kiln-test-base"
                and r.getMessage().startswith("test base environment ") and " in " in r.getMessage()]
    assert len(prepared) == 1, prepared  # the one base, made (or found) in the background
    made = base_env(base_pins())
    assert made.root.name[:16] in prepared[0] and changed_files(made.root) == []
