"""aarch64 cells through a real nightly: a plain C extension's variant with ``platform = ["x86_64", "aarch64"]``
builds both wheels (the aarch64 one cross-built by Debian's aarch64-linux-gnu-gcc and tagged manylinux by
auditwheel), publishes them into the variant's one index, and accounts for the aarch64 cell: its suite "not run"
for want of an aarch64 runner, never passed. ``kiln which`` and uv, asked for an aarch64 machine, pick its wheel."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import zipfile
from pathlib import Path

import pytest
from packaging.utils import parse_wheel_filename

from kiln.core.errors import EXIT_OK
from kiln.core.manifest import RunManifest
from kiln.flows.cli import main
from kiln.flows.report.summary import render_text
from kiln.tasks.build import cross
from kiln.tasks.project.config import load_config
from kiln.tasks.run.coverage import coverage_rows
from tests.helpers.gitrepo import git_project

AARCH64 = cross.target("aarch64")
EM_AARCH64, EM_X86_64 = 183, 62
KILN_TOML = '''[project]
package = "crossdot"
distribution = "crossdot"
version = "0.1.0"
source = "src/crossdot"
requires_python = ">=3.8"

[[variants]]
name = "cpu"
backend = "cpu"
python = ["3.11"]
platform = ["x86_64", "aarch64"]

[build]
backend = "pep517"

[[suites]]
name = "unit"
paths = ["tests"]
publish_untested = true  # its aarch64 cell's suite cannot run on this x86_64 machine

[publish]
default_target = "local"

[publish.targets.local]
url = "file://{out}/index"
'''
TEST = '''import crossdot


def test_dot():
    assert crossdot.dot([1.0, 2.0], [3.0, 4.0]) == 11.0
'''


def _with_kiln_toml(project: Path) -> None:
    (project / "kiln.toml").write_text(KILN_TOML)
    (project / "tests").mkdir()
    (project / "tests" / "test_dot.py").write_text(TEST)


def _machine(wheel: Path) -> int:
    """The ELF e_machine of the wheel's one extension module."""
    with zipfile.ZipFile(wheel) as archive:
        [library] = [n for n in archive.namelist() if n.endswith(".so")]
        data = archive.read(library)
    assert data[:4] == b"\x7fELF", library
    return int.from_bytes(data[18:20], "little")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_nightly_builds_publishes_and_accounts_for_an_aarch64_cell(prefect_server, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from kiln.flows.nightly import nightly_flow

    if cross.compiler(AARCH64) is None:
        pytest.skip("no aarch64-linux-gnu-gcc: install Debian's gcc-aarch64-linux-gnu")
    try:
        cross.staged_include(AARCH64, cross.default_cache_dir())
    except urllib.error.URLError as exc:
        pytest.skip(f"the pinned aarch64 CPython headers could not be downloaded (no network?): {exc}")
    config_path = git_project("crossdot", tmp_path, edit=_with_kiln_toml)
    out = tmp_path / "out"
    state = nightly_flow(config_path=str(config_path), out=str(out), return_state=True)
    run = RunManifest.load(out / str(state.state_details.flow_run_id))
    units = {u.id: u for u in run.units}
    wheels = {a.variant: Path(run.verify(a)) for a in run.artifacts_of("wheel")}
    assert set(wheels) == {"cpupy311", "cpupy311aarch64"}, units
    x86, arm = wheels["cpupy311"], wheels["cpupy311aarch64"]
    assert {t.platform for t in parse_wheel_filename(arm.name)[3]} == {"manylinux_2_17_aarch64"}, arm.name
    assert all(t.platform.endswith("_x86_64") for t in parse_wheel_filename(x86.name)[3]), x86.name
    assert (_machine(arm), _machine(x86)) == (EM_AARCH64, EM_X86_64)
    # the x86_64 cell is tested; the aarch64 cell's suite is not run, and says why
    assert units["test/unit/cpupy311"].state == "completed", units["test/unit/cpupy311"].message
    aarch64_suite = units["test/unit/cpupy311aarch64"]
    assert aarch64_suite.state == "not_run" and "no aarch64 runner" in aarch64_suite.message, aarch64_suite
    rows = {r.variant: r for r in coverage_rows(load_config(config_path), run)}
    assert (rows["cpupy311"].platform, rows["cpupy311"].state) == ("x86_64", "tested")
    assert (rows["cpupy311aarch64"].platform, rows["cpupy311aarch64"].state) == ("aarch64", "untested")
    assert "no aarch64 runner" in rows["cpupy311aarch64"].why
    text = render_text(run)  # the run's summary names the aarch64 cell, its wheel and why it is untested
    assert any(ln.split()[:2] == ["cpupy311aarch64", "untested"] and " aarch64 " in ln and arm.name in ln
               for ln in text.splitlines()), text
    assert state.is_completed(), units
    _both_served(out / "index" / "nightly" / "cpu" / "simple", arm.name, tmp_path, capsys)


def _both_served(index: Path, aarch64_wheel: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The variant's one index holds both CPUs' wheels; an aarch64 machine is given the aarch64 one."""
    page = json.loads((index / "crossdot" / "index.json").read_text())
    served = sorted(f["filename"] for f in page["files"])
    assert any(n.endswith("_x86_64.whl") for n in served) and aarch64_wheel in served, served
    url = index.as_uri() + "/"
    capsys.readouterr()
    status = main(["which", url, "--project", "crossdot", "--python", "3.11", "--platform", "manylinux_2_28_aarch64",
                   "--torch", "none", "--cuda", "none", "--rocm", "none", "--arch", "none"])
    said = capsys.readouterr().out
    assert status == EXIT_OK, said
    assert said.splitlines()[0].startswith(f"kiln which: {aarch64_wheel} fits Python 3.11"), said
    target = tmp_path / "uv-aarch64"
    subprocess.run([shutil.which("uv") or "uv", "pip", "install", "--no-cache", "--quiet", "--no-deps",
                    "--python-platform", "aarch64-manylinux_2_28", "--python-version", "3.11", "--index-url", url,
                    "--target", str(target), "crossdot"], check=True, timeout=300)
    [record] = target.glob("crossdot-*.dist-info/WHEEL")
    assert "-manylinux_2_17_aarch64" in record.read_text(), record.read_text()
