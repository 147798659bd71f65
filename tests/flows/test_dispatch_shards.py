"""A sharded suite is dispatched shard by shard: one flow run each, so a pool's workers can share them, all split
by the plan the dispatcher pinned in the run first (the scale-out module runs them on two real workers)."""

from __future__ import annotations

import json
import tomllib
import uuid

import pytest
from prefect import flow

from kiln.flows.run.dispatch import DEPLOYMENT, dispatch_suite
from kiln.tasks.project.config import parse_config
from kiln.tasks.testing.shards import CONTENT_TYPE, DURATIONS_INFO, SHARDS_INFO, durations_key, pinned
from tests.flows.test_dispatch import REPO, _dispatched_runs, _record, deploy_gpu_tests


@pytest.mark.slow
def test_each_shard_is_its_own_dispatched_run_and_fails_alone_at_its_deadline(prefect_server, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_GPU_COUNT", "1")  # this machine could run the suite: it waits for the pool's worker
    pool = f"gpu-{uuid.uuid4().hex[:8]}"
    deploy_gpu_tests(pool)
    data = tomllib.loads((REPO / "kiln.toml").read_text())
    gpu = next(s for s in data["suites"] if s.get("gpus"))
    gpu.update(pool=pool, deadline_s=2, shards="auto", shard_target_s=5, variants=["cu130"])
    config = parse_config(data, REPO)
    run = _record(tmp_path)
    durations = {f"tests/test_k.py::test_{n}": float(n) for n in range(6)}  # 15 s: three shards of 5 s
    key = durations_key(config.testing.quarantine.history, "kernels-gpu.cu130")
    run.store.put_page(key, json.dumps({"durations": durations}).encode(), CONTENT_TYPE, "no-cache", None)

    @flow
    def parent():
        return dispatch_suite(config, config.suites_by_name["kernels-gpu"], DEPLOYMENT.format(flow="test", pool=pool),
                              run)

    units = parent()

    # "auto" wants three but is bounded by the pool's live workers: none here, so one shard
    assert [u.id for u in units] == ["test/kernels-gpu/cu130"]
    info = run.info()
    assert info[f"{SHARDS_INFO}test/kernels-gpu/cu130"] == 1 and info[f"{DURATIONS_INFO}test/kernels-gpu/cu130"] == durations
    assert pinned(info).durations == {"test/kernels-gpu/cu130": durations}
    [dispatched] = _dispatched_runs(run.run_id, "kernels-gpu")
    assert dispatched.parameters["shard"] == 1 and dispatched.state.is_cancelled()
    assert units[0].state == "failed" and "started testing kernels-gpu shard 1 of 1 within 2s" in units[0].message


@pytest.mark.slow
def test_two_shards_are_two_dispatched_runs_each_failing_as_its_own_unit(prefect_server, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_GPU_COUNT", "1")
    pool = f"gpu-{uuid.uuid4().hex[:8]}"
    deploy_gpu_tests(pool)
    data = tomllib.loads((REPO / "kiln.toml").read_text())
    gpu = next(s for s in data["suites"] if s.get("gpus"))
    gpu.update(pool=pool, deadline_s=2, shards=2, variants=["cu130"])
    config = parse_config(data, REPO)
    run = _record(tmp_path)

    @flow
    def parent():
        return dispatch_suite(config, config.suites_by_name["kernels-gpu"], DEPLOYMENT.format(flow="test", pool=pool),
                              run)

    units = parent()

    assert [u.id for u in units] == [f"test/kernels-gpu/cu130/shard-{n}-of-2" for n in (1, 2)]
    dispatched = sorted(_dispatched_runs(run.run_id, "kernels-gpu"), key=lambda r: r.parameters["shard"])
    assert [r.parameters["shard"] for r in dispatched] == [1, 2] and all(r.state.is_cancelled() for r in dispatched)
    assert [r.name for r in dispatched] == ["test kernels-gpu shard 1/2", "test kernels-gpu shard 2/2"]
    for n, unit in enumerate(units, 1):
        assert unit.state == "failed" and f"testing kernels-gpu shard {n} of 2 within 2s" in unit.message, unit
