"""Scale-out on real parts: PostgreSQL, a Prefect server on it, moto's S3 server, workers on three pools.

The module builds the cluster with the docs' own "Scaling out" recipe (docs/guides/scale-out.md)
(tests/helpers/cluster.py): two build workers, one CPU worker and one GPU
worker (a GPU node simulated on the CPU with the GPU-count override), each in
an empty directory of its own; every unit clones the project (the ``acme``
fixture, committed in a git repository the workers reach by a ``file://``
URL) at the run's commit. The artifact store and the publish target are
buckets of moto's S3 server: the only thing the workers share.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest
from kiln.flows.report.summary import render_markdown
from tests.helpers.cluster import ARTIFACTS, INDEX, VARIANTS, Cluster, team_cluster, trigger, with_sharded_suite
from tests.helpers.gitrepo import commit_all
from tests.helpers.s3 import moto_s3_server
from tests.helpers.venvs import make_venv
from tests.helpers.venvs import run as run_in_venv

pytestmark = [pytest.mark.scaleout, pytest.mark.slow, pytest.mark.timeout(3600)]

NIGHTLY_DEADLINE_S = 1500  # a whole nightly on a loaded 2-core machine, four workers sharing it


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    import boto3

    with moto_s3_server() as endpoint:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        for bucket in (ARTIFACTS, INDEX):
            client.create_bucket(Bucket=bucket)
        yield endpoint


@pytest.fixture(scope="module")
def deployed(tmp_path_factory, s3) -> Iterator[tuple[Cluster, Path]]:
    # two GPU workers (one simulated node): a sharded suite's two shards, dispatched apart, take one each
    with team_cluster(tmp_path_factory.mktemp("scaleout"), s3, {"kiln-build": 2, "kiln-gpu": 2}) as deployed:
        yield deployed


def _children(made: Cluster, run_id: str) -> list:
    """The flow runs a nightly dispatched to a deployment (not its in-process subflows): each names its run."""
    with made.client() as client:
        return [r for r in client.read_flow_runs(limit=200)
                if r.parameters.get("run_id") == run_id and r.deployment_id is not None]


def _pool(made: Cluster, flow_run) -> str:
    return flow_run.work_pool_name or ""


def _record(endpoint: str, run_id: str, out: Path):
    from kiln.core.record import open_record
    from kiln.core.store import open_store

    store = open_store(f"s3://{ARTIFACTS}/store", root=out, region="us-east-1", endpoint=endpoint)
    return open_record(store, run_id, out)


def test_two_nightlies_at_once_run_every_unit_on_its_pool_and_publish_an_index_pip_installs(deployed, s3, tmp_path):
    made, project = deployed
    first, second = trigger(made), trigger(made)  # two nightlies on the same server and target, at once
    for run_id in (first, second):
        final = made.wait_final(run_id, NIGHTLY_DEADLINE_S)
        assert final.state.is_completed(), f"{final.state.message}\n{made.logs()}"
    assert first != second
    wheels = []
    for run_id in (first, second):
        children = _children(made, run_id)
        builds = sorted((tuple(r.parameters["variants"]), _pool(made, r)) for r in children
                        if "variants" in r.parameters)
        assert builds == [(("cpu",), "kiln-build"), (("cu130",), "kiln-build")]
        suites = sorted((tuple(r.parameters["suites"]), _pool(made, r)) for r in children if "suites" in r.parameters)
        assert suites == [(("gpu",), "kiln-gpu"), (("unit",), "kiln-process")]
        publishes = [_pool(made, r) for r in children if "channel" in r.parameters]
        assert publishes == ["kiln-process"]
        assert all(r.state.is_completed() for r in children)
        record = _record(s3, run_id, tmp_path / run_id)
        units = {u.id: u for u in record.units()}
        assert {units[f"build/{v}/wheel"].state for v in VARIANTS} == {"completed"}
        assert units["test/unit/cpu"].state == "completed" and units["test/gpu/cu130"].state == "completed"
        kinds = {(a.kind, a.variant) for a in record.artifacts()}
        assert {("wheel", v) for v in VARIANTS} <= kinds and any(k == "report" for k, _ in kinds)
        wheels.append({a.variant: (a.path.rsplit("/", 1)[-1], a.sha256) for a in record.artifacts() if a.kind == "wheel"})
        assert record.header.ref == record.header.source.commit and len(record.header.ref) == 40
        summary = render_markdown(record.manifest())  # the nightly's summary, from the record alone
        assert "| build |" in summary and "## Published indexes" in summary and "nightly/cpu" in summary, summary
    _pip_installs_from_the_published_index(s3, tmp_path)
    assert wheels[0] == wheels[1]  # the same commit, dispatched twice
    _a_local_build_and_its_witness_give_the_dispatched_wheels(made, project, wheels[0], tmp_path)


def _a_local_build_and_its_witness_give_the_dispatched_wheels(made: Cluster, project: Path,
                                                                dispatched: dict[str, tuple[str, str]],
                                                                tmp_path: Path) -> None:
    """`kiln build --witness` of the nightlies' commit on this machine (no worker, no dispatch, its own caches): each
    wheel is the dispatched builds' bytes, and the witness builds each again with every cache bypassed."""
    out = tmp_path / "local-build"
    made.run(f"cd {shlex.quote(str(project))} && {shlex.quote(sys.executable)} -m kiln.flows.cli build --witness"
             f" --config kiln.toml --out {shlex.quote(str(out))}", timeout=1500)
    local = RunManifest.load(out / "latest")
    assert {a.variant: (a.path.rsplit("/", 1)[-1], a.sha256) for a in local.artifacts_of("wheel")} == dispatched
    [witness] = [u for u in local.units if u.id == "build/witness"]
    assert witness.message.startswith(f"witnessed: {len(dispatched)} wheels identical"), witness.message


def _pip_installs_from_the_published_index(endpoint: str, tmp_path: Path) -> None:
    from kiln.core.store import open_store
    from kiln.release.read.serve import IndexServer

    store = open_store(f"s3://{INDEX}/simple", root=tmp_path, region="us-east-1", endpoint=endpoint)
    with IndexServer(store, "nightly/cpu/simple") as served:
        python = make_venv(tmp_path / "venv")
        install = run_in_venv([str(python), "-m", "pip", "install", "--no-deps", "--ignore-installed",
                               "--index-url", served.url, "acme-ops", "kiln-runtime"], cwd=tmp_path)
    assert install.returncode == 0, install.stdout + install.stderr
    probe = run_in_venv([str(python), "-c", "import acme; print(acme.checksum(b'kiln'))"], cwd=tmp_path)
    assert probe.returncode == 0 and probe.stdout.strip().endswith("3292000"), probe.stdout + probe.stderr


def _running_build(made: Cluster, run_id: str, variant: str, deadline_s: float = 900):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for child in _children(made, run_id):
            if child.parameters.get("variants") == [variant] and child.state.is_running() \
                    and child.infrastructure_pid:
                return child
        time.sleep(1)
    raise AssertionError(f"no running build of {variant} for run {run_id}\n{made.logs()}")


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        chain.append(pid)
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: the parent's pid
    return chain


def _lose_machine(made: Cluster, flow_run) -> None:
    """SIGKILL the build worker running ``flow_run`` and the flow run's own process group: a lost machine."""
    pid = int(str(flow_run.infrastructure_pid).rsplit(":", 1)[-1])
    chain = _ancestors(pid)
    (worker,) = [w for w in made.workers["kiln-build"] if w.poll() is None and w.pid in chain]
    group = os.getpgid(pid)
    os.killpg(worker.pid, signal.SIGKILL)
    os.killpg(group, signal.SIGKILL)
    worker.wait(timeout=60)


# A suite of 41 short tests split in two shards by recorded durations, on the GPU pool: its two workers each take
# one run at a time (--limit 1) and share one simulated GPU (the node's limit), so while one shard holds it the
# other is the other worker's.
PLANTED = "sharded/test_many.py::test_fails"
MANY = [f"sharded/test_many.py::test_{n:02d}" for n in range(40)] + [PLANTED]


def _seed_durations(endpoint: str, project: Path) -> dict[str, float]:
    """The suite's durations as a first run would have recorded them (none of these tests has run yet)."""
    from kiln.core.store import open_store
    from kiln.tasks.project.config import load_config
    from kiln.tasks.testing.shards import CONTENT_TYPE, durations_key

    durations = {nodeid: 0.5 + (n % 5) * 0.25 for n, nodeid in enumerate(MANY)}
    store = open_store(f"s3://{ARTIFACTS}/store", root=project, region="us-east-1", endpoint=endpoint)
    key = durations_key(load_config(project / "kiln.toml").testing.quarantine.history, "sharded.cu130")
    store.put_page(key, json.dumps({"durations": durations}).encode(), CONTENT_TYPE, "no-cache", None)
    return durations


def _workers_of_shards(made: Cluster, run_id: str, deadline_s: float) -> dict[int, int]:
    """Until the nightly ends: the worker (its pid) each running shard's flow process descends from."""
    workers, seen = {w.pid for w in made.workers["kiln-gpu"]}, {}
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for child in _children(made, run_id):
            if child.parameters.get("suites") == ["sharded"] and child.state.is_running() and child.infrastructure_pid:
                try:
                    chain = _ancestors(int(str(child.infrastructure_pid).rsplit(":", 1)[-1]))
                except (FileNotFoundError, ProcessLookupError):  # it ended between the read and the look
                    continue
                for pid in set(chain) & workers:
                    seen[child.parameters["shard"]] = pid
        with made.client() as client:
            if client.read_flow_run(run_id).state.is_final():
                return seen
        time.sleep(0.5)
    raise AssertionError(f"nightly {run_id} not final after {deadline_s} s\n{made.logs()}")


def _add_sharded_suite(endpoint: str, project: Path) -> list[list[str]]:
    """The project gains a suite of 41 short tests (one planted failure) in two shards, its durations seeded as a
    first run would have recorded them; the GPU suite leaves the pool to the shards (a third run there could take
    one worker while the other ran both). Returns each shard's part."""
    from kiln.tasks.testing.shards import partition

    (project / "sharded").mkdir()
    (project / "sharded" / "test_many.py").write_text(
        "".join(f"def test_{n:02d}():\n    assert True\n\n\n" for n in range(40))
        + "def test_fails():\n    assert False, 'planted'\n")
    with_sharded_suite(project, 2)
    return partition(MANY, _seed_durations(endpoint, project), 2)


def test_a_lost_build_worker_is_retried_and_a_suites_two_shards_run_on_two_workers(deployed, s3, tmp_path):
    """One nightly (a whole one costs minutes here): the cu130 build's worker is killed mid-unit and the build is
    retried with the reason; then a suite's two shards, dispatched apart, run on the GPU pool's two workers and
    each reports its own part of the tests."""
    made, project = deployed
    split = _add_sharded_suite(s3, project)
    failing = next(n for n, mine in enumerate(split, 1) if PLANTED in mine)
    pinned = commit_all(project, "a suite in two shards, at a nightly of its own version",
                        when="2026-11-30T22:00:00+00:00")
    run_id = trigger(made)
    victim = _running_build(made, run_id, "cu130")
    _lose_machine(made, victim)  # its worker and the build it was running, at once
    # main moves on while the nightly runs: every unit dispatched from now on must still run the run's commit
    commit_all(project, "main moves on", when="2026-11-30T23:00:00+00:00")
    workers = _workers_of_shards(made, run_id, NIGHTLY_DEADLINE_S)
    final = made.wait_final(run_id, 60)
    with made.client() as client:
        lost = client.read_flow_run(victim.id)
    assert lost.state.is_crashed(), lost.state
    assert final.state.is_failed(), f"{final.state.message}\n{made.logs()}"  # the planted failure fails it
    record = _record(s3, run_id, tmp_path / "record")
    assert record.header.ref == pinned
    units = {u.id: u for u in record.units()}
    failed = sorted(uid for uid, u in units.items() if u.state == "failed")
    assert failed == [f"test/sharded/cu130/shard-{failing}-of-2"], {uid: units[uid].message for uid in failed}
    wheel = units["build/cu130/wheel"]
    assert wheel.state == "completed" and "attempt 2" in wheel.message, wheel
    assert "worker lost while building cu130 on pool 'kiln-build'" in wheel.message, wheel
    assert units["build/cpu/wheel"].state == "completed" and units["test/unit/cpu"].state == "completed"
    retried = [r for r in _children(made, run_id) if r.parameters.get("variants") == ["cu130"]]
    assert len(retried) == 2 and sorted(r.state.type.value for r in retried) == ["COMPLETED", "CRASHED"]
    assert {r.parameters["commit"] for r in _children(made, run_id)} == {pinned}, "every unit ran the run's commit"
    _assert_shards(made, run_id, record, split, workers)


def _assert_shards(made: Cluster, run_id: str, record, split: list[list[str]],
                   workers: dict[int, int]) -> None:
    shard_runs = {r.parameters["shard"]: r for r in _children(made, run_id) if r.parameters.get("suites") == ["sharded"]}
    assert sorted(shard_runs) == [1, 2] and {_pool(made, r) for r in shard_runs.values()} == {"kiln-gpu"}
    assert [shard_runs[n].name.split(" @ ")[0] for n in (1, 2)] == ["test sharded shard 1/2", "test sharded shard 2/2"]
    assert sorted(workers) == [1, 2] and workers[1] != workers[2], f"shards ran on workers {workers}"
    units = {u.id: u for u in record.units()}
    reported: dict[str, str] = {}
    for n in (1, 2):
        assert f"test/sharded/cu130/shard-{n}-of-2" in units
        [report] = [a for a in record.artifacts() if a.kind == "report"
                    and a.path.endswith(f"sharded.cu130.shard-{n}-of-2.json")]
        tests = {t["nodeid"]: t["outcome"] for t in json.loads(record.fetch(report).read_text())["tests"]}
        assert set(tests) == set(split[n - 1]), f"shard {n} reported other tests than its part"
        reported |= tests
    assert reported == {nodeid: "failed" if nodeid == PLANTED else "passed" for nodeid in MANY}  # the union
    assert "test/sharded/cu130" not in units, "a sharded suite is its shards' units, not one of its own"


def test_every_process_the_cluster_started_is_stopped_by_pid(deployed):
    made, _ = deployed
    alive = [p.pid for p in made.procs if p.poll() is None]
    assert alive, "the cluster is running while the module's tests run"
    made.close()
    assert all(p.poll() is not None for p in made.procs)
    for proc in made.procs:
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)
