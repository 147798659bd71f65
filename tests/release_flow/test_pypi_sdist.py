"""A pep517 project's release sends its sdist to an upload target with ``sdist = true`` (issue 42, part 2).

Through the release flow's own steps (:func:`kiln.flows.pypi.plan_uploads`, then
:func:`kiln.flows.pypi.upload_release`) against a real pypiserver on loopback: the sdist is built at the
release's public version from the project, recorded in the run, judged by the plan like any file, sent after the
wheel, listed by the server with its sha256; running the upload again sends nothing.
"""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

import pytest
from prefect import flow

from kiln.flows.pypi import plan_uploads, upload_release
from kiln.flows.run.common import open_run
from kiln.release.upload.pypi_index import read_index
from kiln.tasks.project.config import load_config
from tests.helpers.gitrepo import commit_all, init_repo
from tests.helpers.loopback_pypi import PypiServer, pypi_server
from tests.helpers.runkit import make_record
from tests.helpers.wheelkit import make_wheel

TOKEN = "pypi-loopback-token-never-logged"
WHEEL = "tiny_kernels-0.3.0-py3-none-any.whl"
SDIST = "tiny_kernels-0.3.0.tar.gz"


def _project(tmp_path: Path, server: PypiServer, block: str) -> Path:
    """A setuptools package built by its own backend, version 0.3.0, with an upload target that ships its sdist."""
    root = tmp_path / "tiny"
    (root / "tinyk").mkdir(parents=True)
    (root / "tinyk" / "__init__.py").write_text('"""Tiny kernels (a Kiln fixture)."""\n')
    (root / "pyproject.toml").write_text(textwrap.dedent("""\
        [build-system]
        requires = ["setuptools>=64"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "tiny-kernels"
        version = "0.3.0"
        requires-python = ">=3.10"

        [tool.setuptools]
        packages = ["tinyk"]
        """))
    (root / "kiln.toml").write_text(textwrap.dedent(f"""\
        [project]
        package = "tinyk"
        distribution = "tiny-kernels"
        version = "0.3.0"
        source = "tinyk"

        [[variants]]
        name = "cpu"
        backend = "cpu"

        [build]
        backend = "pep517"
        project_dir = "."
        backend_timeout_s = 300

        [publish]
        default_target = "local"

        [publish.targets.local]
        url = "file://{{out}}/index"

        [publish.targets.pypi]
        kind = "upload"
        url = "{server.url}"
        index_url = "{server.index_url}"
        pypi_variant = "cpu"
        token_block = "{block}"
        sdist = true
        """))
    init_repo(root)
    commit_all(root, "a package that ships its sdist to a PyPI-compatible index")
    return root / "kiln.toml"


@flow
def plan_then_upload(config_path: str, out: str, run_id: str) -> tuple[list[str], list[tuple[str, str]]]:
    config = load_config(config_path)
    run = open_run(config, "release", out, run_id=run_id)
    _, refusals = plan_uploads(config, run, "0.3.0")
    states = upload_release(config, run, "0.3.0")
    return refusals, [(state.type.value, state.message or "") for state in states]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_release_uploads_the_wheel_and_the_sdist_at_the_public_version_and_a_rerun_sends_nothing(
        prefect_server, tmp_path):
    from prefect.blocks.system import Secret

    block = f"kiln-pypi-{uuid.uuid4().hex[:8]}"
    Secret(value=TOKEN).save(block)
    with pypi_server(tmp_path / "pypiserver") as server:
        config = _project(tmp_path, server, block)
        run = make_record(config, tmp_path / "out", {})
        wheel = make_wheel(run.view / "wheels" / "cpu", "tiny-kernels", "0.3.0+cpu", payload="this build")
        run.add_artifact(wheel, step="build", kind="wheel", variant="cpu")

        refusals, states = plan_then_upload(str(config), str(tmp_path / "out"), run.run_id)
        assert refusals == [] and [s for s, _ in states] == ["COMPLETED"], states
        [sdist] = run.manifest().artifacts_of("sdist")
        assert Path(sdist.path).name == SDIST
        listed = {f.filename: f.sha256 for f in read_index(server.index_url, "tiny-kernels")}
        assert listed == {WHEEL: listed[WHEEL], SDIST: sdist.sha256}
        units = {u.id: u.state for u in run.units() if u.id.startswith(("publish/pypi/", "build/sdist"))}
        assert units == {"build/sdist": "completed", f"publish/pypi/{WHEEL}": "completed",
                         f"publish/pypi/{SDIST}": "completed"}
        assert server.uploads() == 2

        refusals, states = plan_then_upload(str(config), str(tmp_path / "out"), run.run_id)  # the release's uploads again: all on the index
        assert refusals == [] and states == [("COMPLETED", "upload to pypi: 0 files sent, 2 skipped")]
        assert server.uploads() == 2 and len(run.manifest().artifacts_of("sdist")) == 1  # not rebuilt either
