"""The bench stage of a package whose kernels declare no bench cases: skipped before its environment, against the
stage as it ran before (environment made, measuring server started, an empty kernel list measured).

The project is ``tests/fixtures/projects/tiny`` (two Triton kernels, no ``bench_cases``), its cpu wheel built once
(``build_flow``). Every measured run is ``bench_flow`` on a fresh run record holding that wheel, alternating
(so load from other jobs falls on both alike): **skip** — the stage as it is (the registry's guest says no kernel
declares cases: not run); **as before** — the same call with that check answering "" (the stage then makes the
bench environment and starts the measuring server, as every nightly did). Usage::

    python benchmarks/bench_no_cases.py [--runs 3]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from kiln.core.record import Checkout, RunHeader, create_record
from kiln.core.store import open_store
from kiln.tasks.project.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def _record_with(config_path: Path, out: Path, wheel: Path) -> str:
    config = load_config(config_path)
    store = open_store(config.artifacts.url, root=config.root)
    header = RunHeader(run_id=uuid.uuid4().hex, flow="bench-benchmark", version="0.1.0",
                       source=Checkout(commit="0" * 40, commit_time=1764536823, in_git=True))
    record = create_record(store, header, out)
    copy = record.view / "wheels" / "cpu" / wheel.name
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(wheel, copy)
    record.add_artifact(copy, step="build", kind="wheel", variant="cpu")
    return header.run_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from prefect.testing.utilities import prefect_test_harness

    import kiln.flows.bench as bench
    from kiln.flows.build import build_flow

    with tempfile.TemporaryDirectory() as tmp, prefect_test_harness(server_startup_timeout=600):
        project = Path(tmp) / "tiny"
        shutil.copytree(ROOT / "tests" / "fixtures" / "projects" / "tiny", project)
        config = project / "kiln.toml"
        state = build_flow(config_path=str(config), out=str(Path(tmp) / "build"), variants=["cpu"],
                           return_state=True)
        (wheel,) = {p.resolve() for p in (Path(tmp) / "build").glob("*/wheels/*.whl")}  # the run and out/latest
        assert state.is_completed(), state.message
        real = bench.no_bench_cases
        times: dict[str, list[float]] = {"skip": [], "as before": []}
        for run in range(args.runs):
            for mode in ("skip", "as before"):
                bench.no_bench_cases = real if mode == "skip" else (lambda config: "")  # type: ignore[assignment]
                out = Path(tmp) / f"run-{mode.replace(' ', '-')}-{run}"
                run_id = _record_with(config, out, wheel)
                start = time.monotonic()
                done = bench.bench_flow(config_path=str(config), out=str(out), run_id=run_id, store_history=False,
                                        return_state=True)
                times[mode].append(time.monotonic() - start)
                print(f"{mode}: {times[mode][-1]:.1f} s ({done.type.value})", flush=True)
        bench.no_bench_cases = real
    skip, before = statistics.median(times["skip"]), statistics.median(times["as before"])
    print(f"median of {args.runs}: skip {skip:.1f} s, as before {before:.1f} s, ratio {before / skip:.1f}x")


if __name__ == "__main__":
    main()
