"""``kiln release --from-run RUN``: the release flow publishes a completed nightly's tested wheels under the
release version instead of building; the binaries are the nightly's and the release's record names the run; a
wheel the build ledger does not vouch for is refused, however the record was rewritten."""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
import zipfile
from pathlib import Path

from kiln.core.manifest import Unit
from kiln.core.record import RunHeader, RunRecord, create_record, open_record
from kiln.core.store import open_store
from kiln.flows.release import approved_release_flow
from kiln.tasks.project.config import load_config
from kiln.tasks.promotion import FINAL_STATE_INFO, PROMOTED_INFO
from kiln.tasks.run import ledger
from tests.helpers.gitrepo import commit_all, init_repo
from tests.helpers.runkit import CLEAN
from tests.helpers.wheelkit import make_wheel

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "fixtures" / "projects" / "tiny"
NIGHTLY = "0.3.0.dev20261206010203+cpu"


def _project(tmp_path: Path) -> Path:
    root = tmp_path / "tiny"
    shutil.copytree(TINY, root, ignore=shutil.ignore_patterns(".kiln", "__pycache__"))
    init_repo(root)
    config = root / "kiln.toml"
    text = config.read_text()
    config.write_text(text[:text.index("[[variants]]")] + text[text.index('[[variants]]\nname = "cpu"'):])
    commit_all(root, "the cpu variant only")
    return config


def _nightly(config_path: Path, out: Path, completed: bool = True) -> RunRecord:
    """A nightly's record in the project's artifact store, as a nightly that tested and published its cpu wheel
    leaves it."""
    config = load_config(config_path)
    store = open_store(config.artifacts.url, root=config.root)
    run = create_record(store, RunHeader(run_id=f"nightly-{uuid.uuid4().hex[:8]}", flow="nightly",
                                         version=NIGHTLY, source=CLEAN), out)
    wheel = make_wheel(run.view / "wheels" / "cpu", "tiny-kernels", NIGHTLY,
                       files={"tiny_kernels/_kernels.so": os.urandom(4096)})
    artifact = run.add_artifact(wheel, step="build", kind="wheel", variant="cpu")
    ledger.record_wheels(store, run.header, [artifact])  # as the build flow does: its word alone vouches
    run.record_all([Unit("build/cpu", "build", "completed", variant="cpu"),
                    Unit("test/unit/cpu", "test", "completed", variant="cpu", suite="unit"),
                    Unit(f"publish/cpu/{wheel.name}", "publish", "completed", variant="cpu", message="added")])
    run.set_info(FINAL_STATE_INFO, {"state": "COMPLETED" if completed else "FAILED",
                                    "message": "nightly: 3 units completed" if completed else "1 unit failed"})
    return run


def _binaries(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as archive:
        return {n: hashlib.sha256(archive.read(n)).hexdigest() for n in archive.namelist()
                if ".dist-info/" not in n and not n.endswith("/")}


def test_a_promoted_release_publishes_the_nightlys_binaries_and_its_record_names_the_run(prefect_server,
                                                                                          tmp_path):
    config = _project(tmp_path)
    nightly = _nightly(config, tmp_path / "nightly-out")
    out = tmp_path / "out"
    state = approved_release_flow(version="0.3.0", config_path=str(config), out=str(out), dry_run=True,
                                  from_run=nightly.run_id, return_state=True)
    assert state.is_completed(), state.message
    release = open_record(nightly.store, (out / "latest").resolve().name, out)  # the release's view
    promoted = release.info()[PROMOTED_INFO]
    assert promoted["run_id"] == nightly.run_id and promoted["version"] == NIGHTLY
    [wheel] = [release.fetch(a) for a in release.artifacts() if a.kind == "wheel"]
    assert wheel.name == "tiny_kernels-0.3.0+cpu-py3-none-any.whl"
    [source] = [nightly.fetch(a) for a in nightly.artifacts() if a.kind == "wheel"]
    assert _binaries(wheel) == _binaries(source) and len(_binaries(source)) >= 2
    assert not [u for u in release.units() if u.stage == "build" and not u.id.startswith("promote/")]  # no build
    assert [u.message for u in release.units() if u.id == "test/unit/cpu"] == [
        f"in nightly run {nightly.run_id}"]


def test_a_nightly_that_did_not_complete_is_refused_naming_it(prefect_server, tmp_path):
    config = _project(tmp_path)
    nightly = _nightly(config, tmp_path / "nightly-out", completed=False)
    state = approved_release_flow(version="0.3.0", config_path=str(config), out=str(tmp_path / "out"),
                                  dry_run=True, from_run=nightly.run_id, return_state=True)
    assert state.is_failed()
    assert f"run {nightly.run_id} did not complete (1 unit failed)" in state.message


def test_a_wheel_swapped_together_with_its_record_is_refused_naming_the_wheel(prefect_server, tmp_path):
    config = _project(tmp_path)
    nightly = _nightly(config, tmp_path / "nightly-out")
    [artifact] = [a for a in nightly.artifacts() if a.kind == "wheel"]
    # A writer of the run record (the build or test role) swaps the wheel and rewrites its entry to match.
    swapped = make_wheel(tmp_path / "attacker", "tiny-kernels", NIGHTLY, files={"tiny_kernels/_kernels.so": b"evil"})
    local = nightly.view / artifact.path
    local.write_bytes(swapped.read_bytes())
    nightly.add_artifact(local, step="build", kind="wheel", variant="cpu")
    out = tmp_path / "out"

    state = approved_release_flow(version="0.3.0", config_path=str(config), out=str(out), dry_run=True,
                                  from_run=nightly.run_id, return_state=True)

    assert state.is_failed()
    assert f"refusing run {nightly.run_id}'s cpu wheel {local.name}: its sha256" in state.message, state.message
    assert "the build step recorded" in state.message
    assert not list(out.rglob("tiny_kernels-0.3.0+cpu-*.whl"))  # nothing promoted
