"""``kiln bisect`` installs only bytes the build step vouched for, and never writes the store it reads.

A run of the tiny project's commit is recorded as the build flow records it (the wheel in the run record,
then its sha256 in the build ledger). Two attacks by anything that can write run records or bisect's cache
— a wheel swapped together with its run record, and a wheel planted under ``bisect-wheels/`` with its own
``.sha256`` — are refused by the flow's own ``try_commit`` before any environment is made.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from kiln.core.errors import AccessDeniedError, IntegrityError
from kiln.core.fsutil import sha256_bytes
from kiln.core.record import Checkout, RunHeader, RunRecord, create_record
from kiln.core.store import LocalStore
from kiln.flows.bisect import _read_only, try_commit
from kiln.release.stores.policies import policies_from_config, read_only, s3_target, session_policy
from kiln.release.stores.readonly import ReadOnlyStore
from kiln.tasks.project.config import KilnConfig, load_config
from kiln.tasks.run import bisect, ledger
from kiln.tasks.run.runs import artifact_store
from tests.helpers.gitrepo import git, git_project

TEST = "tests/test_tiny.py::test_tiny_imports"
WHEEL = "tiny_kernels-0.1.0+cpu-py3-none-any.whl"


@pytest.fixture
def project(tmp_path: Path) -> tuple[KilnConfig, str]:
    config = load_config(git_project("tiny", tmp_path))
    return config, git(config.root, "rev-parse", "HEAD")


def _built(config: KilnConfig, commit: str, data: bytes, out: Path) -> RunRecord:
    """A build run of ``commit`` recorded as the build flow records it: the wheel, then the ledger."""
    store = artifact_store(config)
    run = create_record(store, RunHeader("build-1", "build", "0.1.0", Checkout(commit, 0, (), True), time.time()), out)
    path = run.view / "wheels" / "cpu" / WHEEL
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    ledger.record_wheels(store, run.header, run.add_artifacts([(path, "build", "wheel", "cpu")]))
    return run


def _refused(config: KilnConfig, commit: str, work: Path, match: str) -> None:
    """``try_commit`` refuses before it makes an environment or fetches a wheel: nothing is installed."""
    store = _read_only(config)
    with pytest.raises(IntegrityError, match=re.escape(match)):
        try_commit.fn(config, store, bisect.runs_by_commit(store), commit, "cpu", TEST, work)
    here = work / commit[:12]
    assert not (here / "env").exists() and not list(here.rglob("*.whl"))


def test_a_wheel_swapped_together_with_its_run_record_is_refused(project, tmp_path):
    config, commit = project
    run = _built(config, commit, b"the wheel the build step built", tmp_path / "out")
    honest = sha256_bytes(b"the wheel the build step built")
    evil = run.view / "wheels" / "cpu" / WHEEL
    evil.write_bytes(b"a wheel with a .pth that runs at every start")
    run.add_artifact(evil, step="test", kind="wheel", variant="cpu")  # file and record both rewritten
    _refused(config, commit, tmp_path / "work", f"refusing run build-1's cpu wheel wheels/cpu/{WHEEL}: its sha256 "
                                                f"is {sha256_bytes(evil.read_bytes())}, but the build step recorded "
                                                f"{honest}")


def test_a_wheel_planted_where_bisect_keeps_its_builds_is_refused(project, tmp_path):
    config, commit = project
    store = artifact_store(config)
    key = f"bisect-wheels/{commit}/cpu/x.whl"
    store.put_immutable(key, b"planted", "application/octet-stream", "no-cache")
    store.put_immutable(f"{key}.sha256", sha256_bytes(b"planted").encode(), "text/plain", "no-cache")
    _refused(config, commit, tmp_path / "work", f"refusing {store.url}/{key}: the build ledger holds no hash for it")


def test_a_vouched_wheel_is_used_and_a_kept_build_is_found_again(project, tmp_path):
    config, commit = project
    run = _built(config, commit, b"built", tmp_path / "out")
    store = _read_only(config)
    path, origin = bisect.stored_wheel(store, bisect.runs_by_commit(store)[commit], "cpu", tmp_path / "work")
    assert path.read_bytes() == b"built" and origin == "run build-1"
    other = "f" * 40
    kept = tmp_path / "kept" / WHEEL
    kept.parent.mkdir()
    kept.write_bytes(b"built by bisect")
    bisect.keep_build(artifact_store(config), other, "cpu", kept)  # with the build step's store
    found = bisect.cached_build(store, other, "cpu", tmp_path / "work")
    assert found is not None and found.read_bytes() == b"built by bisect"
    assert run.store.get(ledger.ledger_key(other, "cpu", WHEEL)) == f"{sha256_bytes(b'built by bisect')}\n".encode()


def test_bisect_reads_the_store_read_only(project, tmp_path):
    config, _ = project
    store = _read_only(config)
    assert isinstance(store, ReadOnlyStore)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(AccessDeniedError, match="read-only"):
        store.put_immutable("runs/x/run.json", b"{}", "application/json", "no-cache")
    with pytest.raises(AccessDeniedError, match="read-only"):
        store.put_page("test-history/quarantine.json", b"{}", "application/json", "no-cache", None)
    local = ReadOnlyStore(LocalStore(tmp_path / "plain"), "a test")
    with pytest.raises(AccessDeniedError, match="nothing was written"):
        local.delete("anything")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_the_read_only_session_policy_allows_reads_alone():
    config = load_config(Path(__file__).resolve().parents[2] / "kiln.toml")
    bucket = s3_target(config)[0]
    document = read_only(policies_from_config(config)["test"], bucket)
    allowed = {a for s in document["Statement"] if s["Effect"] == "Allow" for a in s["Action"]}
    assert allowed == {"s3:GetObject", "s3:ListBucket"}
    denied = next(s for s in document["Statement"] if s["Sid"] == "DenyEveryWrite")
    assert denied["Resource"] == [f"arn:aws:s3:::{bucket}/*"] and "s3:PutObject*" in denied["Action"]
    session_policy(document)  # fits STS's limit
