"""Promotion (kiln.tasks.promotion): a completed nightly's tested, published wheel under the release version
keeps every binary byte for byte; a run that did not complete, whose wheel was not tested or published, or whose
wheel the build ledger does not vouch for, is refused naming it."""

from __future__ import annotations

import hashlib
import os
import re
import uuid
import zipfile
from pathlib import Path

import pytest

from kiln.core.errors import IntegrityError
from kiln.core.manifest import RunManifest, Unit
from kiln.core.record import Checkout, RunHeader
from kiln.core.store import LocalStore
from kiln.release.index.variants import read_wheel_variant
from kiln.tasks.promotion import (
    FINAL_STATE_INFO,
    PromotedWheel,
    PromotionRefusedError,
    promote,
    promotion_info,
    promotion_refusals,
)
from kiln.tasks.run.ledger import record_wheels
from tests.helpers.runkit import CLEAN, variant_document
from tests.helpers.wheelkit import make_wheel

NIGHTLY = "0.3.0.dev20261206010203+cpu"
WHEEL = f"tiny_kernels-{NIGHTLY}-py3-none-manylinux_2_28_x86_64.whl"
COMPLETED = {"state": "COMPLETED", "message": "nightly: 4 units completed"}


def _nightly(root: Path, *, final: dict[str, str] | None = COMPLETED, tested: str | None = "completed",
             published: bool = True) -> RunManifest:
    """A nightly's record as its flow leaves it: a cpu wheel with a shared library and a .data member."""
    data_dir = f"tiny_kernels-{NIGHTLY}.data"
    wheel = make_wheel(root / "wheels" / "cpu", "tiny-kernels", NIGHTLY, tag="py3-none-manylinux_2_28_x86_64",
                       files={"tiny_kernels/_kernels.so": os.urandom(4096),
                              f"{data_dir}/data/share/tiny/kernel.cubin": os.urandom(2048)})
    run = RunManifest(root=root, run_id=f"nightly-{uuid.uuid4().hex[:8]}", flow="nightly", version=NIGHTLY)
    run.add_artifact(wheel, step="build", kind="wheel", variant="cpu")
    run.add_unit(Unit("build/cpu", "build", "completed", variant="cpu"))
    if tested:
        run.add_unit(Unit("test/unit/cpu", "test", tested, variant="cpu", suite="unit"))  # type: ignore[arg-type]
    if published:
        run.add_unit(Unit(f"publish/cpu/{WHEEL}", "publish", "completed", variant="cpu", message="added"))
    if final is not None:
        run.info[FINAL_STATE_INFO] = final
    return run


def _promote(nightly: RunManifest, out: Path, built_from: Checkout = CLEAN) -> list[PromotedWheel]:
    """Promote ``nightly`` once its build has recorded its wheels in the build ledger, as the build flow does."""
    ledger = LocalStore(nightly.root.parent / "store")
    record_wheels(ledger, RunHeader(nightly.run_id, "nightly", NIGHTLY, built_from), nightly.artifacts)
    return promote(nightly, "0.3.0", out, ledger=ledger, built_from=built_from)


def _members(wheel: Path) -> dict[str, str]:
    """sha256 of every member outside .dist-info, the version dropped from a .data directory's name."""
    with zipfile.ZipFile(wheel) as archive:
        return {(n.split("/", 1)[0].split("-")[0] + ".data/" + n.split("/", 1)[1] if ".data/" in n else n):
                hashlib.sha256(archive.read(n)).hexdigest()
                for n in archive.namelist() if ".dist-info/" not in n and not n.endswith("/")}


def test_a_promoted_nightly_wheel_keeps_every_binary_and_names_its_run(tmp_path):
    nightly = _nightly(tmp_path / "nightly")
    [promoted] = _promote(nightly, tmp_path / "release")
    assert promoted.path.name == "tiny_kernels-0.3.0+cpu-py3-none-manylinux_2_28_x86_64.whl"
    source = tmp_path / "nightly" / "wheels" / "cpu" / WHEEL
    before, after = _members(source), _members(promoted.path)
    assert len(before) >= 3 and before == after  # the module, the .so and the .data member, byte for byte
    with zipfile.ZipFile(promoted.path) as archive:
        metadata = archive.read("tiny_kernels-0.3.0+cpu.dist-info/METADATA").decode()
    assert "\nVersion: 0.3.0+cpu\n" in metadata
    info = promotion_info(nightly, [promoted])
    assert info["run_id"] == nightly.run_id and info["version"] == NIGHTLY
    assert info["wheels"] == [{"variant": "cpu", "from": WHEEL, "from_sha256": nightly.artifacts[0].sha256,
                               "to": promoted.path.name, "kind": "wheel"}]


def test_a_promoted_nightly_carries_its_variant_wheels_under_the_release_version_label_and_binaries_kept(tmp_path):
    nightly = _nightly(tmp_path / "nightly")
    public, tag = NIGHTLY.split("+")[0], "py3-none-manylinux_2_28_x86_64"
    document = variant_document("null", {})
    with zipfile.ZipFile(tmp_path / "nightly" / "wheels" / "cpu" / WHEEL) as archive:  # the same binaries
        files = {n: archive.read(n) for n in archive.namelist() if ".dist-info/" not in n and ".data/" not in n}
    for label in ("null", None):  # the null variant's wheel and the plain default beside it, as the build writes
        wheel = make_wheel(tmp_path / "nightly" / "variant-wheels", "tiny-kernels", public, tag=tag, label=label,
                           variant_json=document if label else None, files=files)
        nightly.add_artifact(wheel, step="build", kind="variant-wheel", variant="cpu")
    promoted = _promote(nightly, tmp_path / "release")
    assert sorted((p.kind, p.path.name) for p in promoted) == [
        ("variant-wheel", f"tiny_kernels-0.3.0-{tag}-null.whl"), ("variant-wheel", f"tiny_kernels-0.3.0-{tag}.whl"),
        ("wheel", f"tiny_kernels-0.3.0+cpu-{tag}.whl")]
    labelled = next(p for p in promoted if p.path.name.endswith("-null.whl"))
    source = tmp_path / "nightly" / "variant-wheels" / f"tiny_kernels-{public}-{tag}-null.whl"
    assert _members(labelled.path) == _members(source) and len(_members(source)) >= 2
    with zipfile.ZipFile(labelled.path) as archive:
        assert archive.read("tiny_kernels-0.3.0.dist-info/variant.json") == document
        assert "\nVersion: 0.3.0\n" in archive.read("tiny_kernels-0.3.0.dist-info/METADATA").decode()
    assert read_wheel_variant(labelled.path.name, labelled.path)["variants"] == {"null": {}}


@pytest.mark.parametrize("kwargs, needle", [
    ({"final": {"state": "FAILED", "message": "nightly: 1 of 4 units failed"}},
     "did not complete (nightly: 1 of 4 units failed)"),
    ({"final": None}, "did not complete (it recorded no end)"),
    ({"tested": None}, f"{WHEEL} (cpu) was not tested"),
    ({"tested": "not_run"}, f"{WHEEL} (cpu) was not tested"),
    ({"published": False}, f"{WHEEL} (cpu) was not published"),
])
def test_a_run_that_did_not_complete_or_whose_wheel_was_not_tested_or_published_is_refused(tmp_path, kwargs,
                                                                                            needle):
    nightly = _nightly(tmp_path / "nightly", **kwargs)
    assert any(needle in line and nightly.run_id in line for line in promotion_refusals(nightly))
    with pytest.raises(PromotionRefusedError, match=nightly.run_id):
        _promote(nightly, tmp_path / "release")
    assert not (tmp_path / "release").exists()  # nothing written


def test_a_release_run_is_not_promoted(tmp_path):
    run = _nightly(tmp_path / "r")
    run.flow = "release"
    assert promotion_refusals(run) == [f"run {run.run_id} is a release run, not a nightly: only a nightly's"
                                       " tested wheels are promoted"]


def _swap(wheel: Path) -> None:
    """Rewrite a wheel's shared library in place (same name, other bytes): what a writer of the store can do."""
    members = {}
    with zipfile.ZipFile(wheel) as archive:
        members = {n: archive.read(n) for n in archive.namelist()}
    members["tiny_kernels/_kernels.so"] = b"\x7fELF not the bytes the build wrote"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)


@pytest.mark.parametrize("kind", ["wheel", "variant-wheel"])
def test_a_wheel_swapped_together_with_its_record_is_refused_naming_it(tmp_path, kind):
    nightly = _nightly(tmp_path / "nightly")
    if kind == "variant-wheel":
        with zipfile.ZipFile(tmp_path / "nightly" / "wheels" / "cpu" / WHEEL) as archive:
            files = {n: archive.read(n) for n in archive.namelist() if ".dist-info/" not in n and ".data/" not in n}
        nightly.add_artifact(make_wheel(tmp_path / "nightly" / "variant-wheels", "tiny-kernels", NIGHTLY.split("+")[0],
                                        tag="py3-none-manylinux_2_28_x86_64", files=files),
                             step="build", kind="variant-wheel", variant="cpu")
    ledger = LocalStore(tmp_path / "store")
    record_wheels(ledger, RunHeader(nightly.run_id, "nightly", NIGHTLY, CLEAN), nightly.artifacts)  # the build's word
    [artifact] = nightly.artifacts_of(kind)
    swapped = tmp_path / "nightly" / artifact.path
    _swap(swapped)
    nightly.add_artifact(swapped, step="build", kind=kind, variant="cpu")  # the record rewritten to match

    with pytest.raises(IntegrityError, match=re.escape(f"refusing run {nightly.run_id}'s cpu wheel {swapped.name}: "
                                                         "its sha256")):
        promote(nightly, "0.3.0", tmp_path / "release", ledger=ledger, built_from=CLEAN)
    assert not (tmp_path / "release").exists()  # nothing written


def test_a_wheel_the_build_ledger_does_not_hold_is_refused_naming_it(tmp_path):
    nightly = _nightly(tmp_path / "nightly")  # recorded in the run, never by a build step in the ledger
    with pytest.raises(PromotionRefusedError, match=re.escape(f"{WHEEL} (cpu) is not in the build ledger of commit")):
        promote(nightly, "0.3.0", tmp_path / "release", ledger=LocalStore(tmp_path / "store"), built_from=CLEAN)
    assert not (tmp_path / "release").exists()


def test_a_nightly_of_a_modified_tree_is_refused_for_nothing_vouches_for_its_wheels(tmp_path):
    nightly = _nightly(tmp_path / "nightly")
    dirty = Checkout(CLEAN.commit, CLEAN.commit_time, ("kernels/ops.py",), in_git=True)
    with pytest.raises(PromotionRefusedError, match=f"run {nightly.run_id} was not built from a clean commit"
                                                    " \\(modified: kernels/ops.py\\)"):
        _promote(nightly, tmp_path / "release", built_from=dirty)
    assert not (tmp_path / "release").exists()
