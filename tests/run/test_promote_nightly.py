"""A real nightly promoted to a release (``kiln release --from-run``): the release publishes the nightly's wheel
under the release version with every binary the nightly tested, and its record names the nightly."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest
from kiln.tasks.promotion import PROMOTED_INFO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # a whole nightly, then a release up to publish


def _binaries(wheel: Path) -> dict[str, str]:
    """sha256 of every member outside .dist-info (the .data directory named without its version)."""
    with zipfile.ZipFile(wheel) as archive:
        return {(n.split("-", 1)[0] + ".data/" + n.split(".data/", 1)[1] if ".data/" in n.split("/", 1)[0] + "/"
                 else n): hashlib.sha256(archive.read(n)).hexdigest()
                for n in archive.namelist() if ".dist-info/" not in n and not n.endswith("/")}


def _wheel(run: RunManifest) -> Path:
    [artifact] = [a for a in run.artifacts_of("wheel", "cpu") if a.state == "ok"]
    return run.root / artifact.path


def test_a_nightly_promoted_to_a_release_keeps_its_binaries_and_the_record_names_it(prefect_server, tinycpu,
                                                                                     tmp_path):
    from kiln.flows.nightly import nightly_flow
    from kiln.flows.release import approved_release_flow

    nightly_state = nightly_flow(config_path=str(tinycpu), out=str(tmp_path / "nightly"), return_state=True)
    assert nightly_state.is_completed(), nightly_state.message
    nightly = RunManifest.load(tmp_path / "nightly" / str(nightly_state.state_details.flow_run_id))

    out = tmp_path / "release"
    state = approved_release_flow(version="0.1.0", config_path=str(tinycpu), out=str(out), dry_run=True,
                                  from_run=nightly.run_id, return_state=True)
    assert state.is_completed(), state.message
    release = RunManifest.load(out / "latest")
    assert release.info[PROMOTED_INFO]["run_id"] == nightly.run_id
    source, promoted = _wheel(nightly), _wheel(release)
    assert promoted.name == source.name.replace(nightly.version.split("+")[0], "0.1.0")
    assert _binaries(promoted) == _binaries(source)
    assert not [u for u in release.units if u.stage == "build" and not u.id.startswith("promote/")]  # not rebuilt
