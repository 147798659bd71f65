"""The witness: a build's wheels built again with every cache bypassed, byte for byte. An honest cache passes;
an entry forged with a matching hash (what a writer of the shared tier or the worker's cache could plant) is
served by the cached build and refused by the witness, naming the wheel and its member."""

from __future__ import annotations

import json

import pytest

from kiln.core.fsutil import sha256_bytes
from kiln.core.manifest import RunManifest
from tests.helpers.projects import copy_project

VERSION = "0.1.0.dev20261206"


def _build(config, out, witness):
    from kiln.flows.build import build_flow

    state = build_flow(str(config), str(out), version=VERSION, variants=["cu130"], witness=witness,
                       return_state=True)
    return state, RunManifest.load(out / str(state.state_details.flow_run_id))


def _forge_one_cubin(cache) -> str:
    """Flip one byte of a cached cubin and rewrite its entry's hash and size to match: a consistent forgery."""
    for entry_path in sorted((cache / "entries").rglob("*.json")):
        entry = json.loads(entry_path.read_text())
        for name, meta in entry["files"].items():
            if name.endswith(".cubin"):
                data = bytearray((cache / "objects" / meta["sha256"][:2] / meta["sha256"]).read_bytes())
                data[len(data) // 2] ^= 0xFF
                sha = sha256_bytes(bytes(data))
                target = cache / "objects" / sha[:2] / sha
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(bytes(data))
                # every mention of the old hash (the unit's manifest entries too): the forgery is consistent
                text = json.dumps(entry).replace(meta["sha256"], sha).replace(f'"size": {meta["size"]}',
                                                                             f'"size": {len(data)}')
                entry_path.write_text(text)
                return name
    raise AssertionError("the build cached no cubin: the forgery would prove nothing")


@pytest.mark.slow
def test_an_honest_build_is_witnessed_and_a_forged_cache_entry_is_refused_naming_the_member(prefect_server,
                                                                                           tmp_path):
    config = copy_project("tiny", tmp_path)
    state, run = _build(config, tmp_path / "out1", witness=True)
    assert state.is_completed(), state.message
    [unit] = [u for u in run.units if u.id == "build/witness"]
    assert unit.state == "completed" and unit.message.startswith("witnessed: 1 wheels identical"), unit.message

    forged = _forge_one_cubin(config.parent / ".kiln" / "cache")
    state, run = _build(config, tmp_path / "out2", witness=True)
    assert state.is_failed(), [(u.id, u.state, u.cache, u.message[:120]) for u in run.units]
    [unit] = [u for u in run.units if u.id == "build/witness"]
    assert unit.state == "failed" and "the witness refuses" in unit.message, unit.message
    [wheel] = [a.path.rsplit("/", 1)[-1] for a in run.artifacts_of("wheel")]
    assert wheel in unit.message and forged.rsplit("/", 1)[-1] in unit.message, unit.message
