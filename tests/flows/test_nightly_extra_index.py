"""A nightly of a pep517 package whose base version sorts below a release on its extra index, end to end.

Real parts: the scmpkg fixture (setuptools + setuptools-scm) committed in a fresh repository, one real
nightly flow run on the session's Prefect server, a ``file://`` extra index (standing in for PyPI: nothing
leaves this machine) holding ``scmpkg 2.0`` and the two projects scmpkg depends on, pip in fresh venvs,
and ``kiln verify`` through its CLI. The check of extra indexes, off for every other test
(tests/conftest.py), is turned on here.
"""

from __future__ import annotations

import logging
import zipfile
from email.parser import BytesParser
from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest
from kiln.flows.cli import main
from kiln.flows.report.summary import render_text
from kiln.release.install.hintrun import parse_hint, run_hint
from kiln.tasks.install_hint import CHECK_ENV
from tests.helpers.gitrepo import git_project
from tests.helpers.wheelkit import make_wheel

pytestmark = pytest.mark.slow

KILN_TOML_TAIL = """
[publish]
default_target = "local"
extra_index_urls = ["{extra}"]

[publish.targets.local]
url = "file://{{out}}/index"
"""


def extra_index(root: Path) -> Path:
    """A PEP 503 index (HTML only) with scmpkg 2.0 and the dependencies the nightly's wheel declares."""
    simple = root / "simple"
    names = {"scmpkg": "2.0", "helper-a": "1.5", "helper-b": "1.0"}
    for name, version in names.items():
        wheel = make_wheel(simple / name, name, version).name
        (simple / name / "index.html").write_text(f'<a href="{wheel}">{wheel}</a>\n')
    (simple / "index.html").write_text("".join(f'<a href="{n}/">{n}</a>\n' for n in names))
    return simple


def _edit(extra: Path):
    def edit(repo: Path) -> None:
        pyproject = repo / "pyproject.toml"  # the package's own build declares helper-a
        pyproject.write_text(pyproject.read_text().replace('requires-python = ">=3.10"\n',
                                                           'requires-python = ">=3.10"\ndependencies = ["helper-a>=1.0"]\n'))
        config = repo / "kiln.toml"
        text = config.read_text().split("[publish]")[0]
        text = text.replace('source = "src/scmpkg"\n', 'source = "src/scmpkg"\ndependencies = ["helper-a<2", "helper-b"]\n')
        config.write_text(text + KILN_TOML_TAIL.format(extra=extra.as_uri()))
    return edit


def _requires_dist(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return BytesParser().parsebytes(archive.read(name)).get_all("Requires-Dist") or []


@pytest.fixture(scope="module")
def nightly(prefect_server, tmp_path_factory):
    """One nightly of scmpkg (base 1.0.0) with scmpkg 2.0 on its extra index; the warnings it logged."""
    from kiln.flows.nightly import nightly_flow

    tmp = tmp_path_factory.mktemp("below")
    extra = extra_index(tmp / "pypi")
    config = git_project("scmpkg", tmp, edit=_edit(extra))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    watched = [logging.getLogger(name) for name in ("prefect.flow_runs", "kiln.tasks.install_hint", "kiln.release.publish.closure")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CHECK_ENV, "on")  # a file:// extra index only
        for logger in watched:
            logger.addHandler(handler)
        closure_log = logging.getLogger("kiln.release.publish.closure")
        level = closure_log.level
        closure_log.setLevel(logging.INFO)  # its info: which check answered the publish stage
        try:
            state = nightly_flow(config_path=str(config), out=str(tmp / "out"), return_state=True)
        finally:
            closure_log.setLevel(level)
            for logger in watched:
                logger.removeHandler(handler)
    run = RunManifest.load(tmp / "out" / str(state.state_details.flow_run_id))
    return state, run, extra, [r.getMessage() for r in records]


def test_the_nightly_warns_at_its_start_and_in_its_summary(nightly):
    state, run, extra, messages = nightly
    assert state.is_completed(), state.message
    assert run.version.startswith("1.0.0.dev")
    warning = (f"VERSION BELOW AN EXTRA INDEX: scmpkg {run.version} sorts below release 2.0 on {extra.as_uri()}, "
               "which an unpinned install takes instead; raise [project] version above 2.0 in kiln.toml")
    assert warning in messages, messages
    building = [i for i, m in enumerate(messages) if "build" in m.lower()]
    assert building and messages.index(warning) < building[0]  # before the build stage said anything
    assert warning in render_text(run).splitlines()[:4]


def test_the_publish_stage_takes_the_dependency_answer_of_the_check_started_after_the_build(nightly):
    state, run, _, messages = nightly
    version = next(a.path for a in run.artifacts_of("wheel")).rsplit("/", 1)[-1].split("-")[1]
    assert f"dependencies of scmpkg=={version} (cpu) answered by the check started after the build" in messages, \
        [m for m in messages if "dependencies" in m]
    assert next(u for u in run.units if u.id == "publish/dependencies/cpu").state == "completed"


def test_project_dependencies_are_merged_into_the_wheel_and_the_summary_states_its_requires_dist(nightly):
    _, run, _, _ = nightly
    wheel = run.root / next(a.path for a in run.artifacts_of("wheel"))
    requires = _requires_dist(wheel)
    assert requires == ["helper-a<2,>=1.0", "helper-b"]  # the build's own line joined with kiln.toml's, then its new one
    version = wheel.name.split("-")[1]
    assert f"scmpkg {version} requires {', '.join(requires)} (its wheel's Requires-Dist)" in render_text(run)


def _hint(run: RunManifest) -> str:
    lines = [line.strip() for line in render_text(run).splitlines() if line.strip().startswith("install: env PIP_CONFIG_FILE=/dev/null pip install --isolated")
             and "/commits/" not in line]  # the channel index's hint; the per-commit index has its own
    assert len(lines) == 1, render_text(run)
    return lines[0].removeprefix("install: ")


def test_the_printed_hint_installs_the_nightlys_exact_version_in_a_fresh_venv(nightly, tmp_path):
    _, run, _, _ = nightly
    version = next(a.path for a in run.artifacts_of("wheel")).rsplit("/", 1)[-1].split("-")[1]
    hint = _hint(run)
    assert hint.endswith(f" scmpkg=={version}") and ".dev" in version
    installed, why = run_hint(parse_hint(hint), tmp_path, timeout=300)
    assert installed == version, why


def test_kiln_verify_runs_the_hint_and_refuses_an_unpinned_one_that_would_take_the_extra_indexs_release(
        nightly, capsys):
    _, run, _, _ = nightly
    hint = _hint(run)
    url = hint.split("--index-url ", 1)[1].split()[0]
    assert main(["verify", url, "--no-install", "--hint", hint]) == 0, capsys.readouterr().out
    assert f"install hint {hint}: ok" in capsys.readouterr().out
    # one pip command naming both indexes, unpinned, would take the extra index's scmpkg 2.0: refused before it runs
    unpinned = hint.split(" && ")[1].rsplit("==", 1)[0]
    assert main(["verify", url, "--no-install", "--hint", unpinned]) != 0
    out = capsys.readouterr().out
    assert out.startswith("FAILED")
    assert f"install hint {unpinned}: scmpkg 2.0 would come from " in out and f"not from the Kiln index {url}" in out
