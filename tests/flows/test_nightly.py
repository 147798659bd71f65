"""End to end: `kiln nightly --out TMP` on the default kiln.toml, in a clean clone.

The nightly runs as a real `kiln` process against the session's Prefect
server, in a fresh clone of this repository at HEAD (a nightly publishes
only a clean commit); the test then reads what a release engineer would
read: the run's run.json, the index, and a pip install from it into a
fresh virtual environment.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from kiln.core.fsutil import sha256_file
from kiln.core.manifest import RunManifest
from kiln.flows.report.console import variant_index
from kiln.flows.report.hint import install_command
from tests.helpers.gitrepo import git
from tests.helpers.indexcheck import check_local_index
from tests.helpers.venvs import make_venv, run

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # the module fixture runs a whole nightly
# The tests that import the int8 quantization Triton kernel's module (kernels/kiln_kernels/_quant_tl.py, imported
# lazily): its own tests that launch it, the registry's (the registry names the kernel) and the loader's rebuild
# test; and tests of the same files that never import it (the fp8 path, the reference, argument checks).
QUANT, REGISTRY, LOADER = "tests/kernels/test_quant.py", "tests/kernels/test_registry.py", "tests/kernels/test_loader.py"
DISTRIBUTED = "tests/distributed/test_expert_parallel.py"  # imports no quantization kernel
LAUNCH_IT = {f"{QUANT}::test_round_trip_bound_holds_for_any_row_magnitude",
             f"{QUANT}::test_same_output_under_torch_compile_fullgraph",
             f"{QUANT}::test_all_zero_rows_give_zero_codes_and_eps_scale",
             f"{REGISTRY}::test_four_kernels", f"{LOADER}::test_artifacts_built_for_sm90_are_found_and_rebuilt"}
NEVER_IMPORT_IT = {f"{QUANT}::test_fp8_on_the_interpreter_takes_the_reference_path", f"{QUANT}::test_rejects_bad_input",
                   f"{LOADER}::test_a_platform_maps_to_the_loaders_device"}


def _share_a_store(clone: Path, store: Path) -> None:
    """The clone's run records and its build caches' shared tier in ``store``, as a team's workers share one, as a
    commit: a second worker cloning the clone gets the same commit and the same store."""
    store.mkdir(mode=0o700)
    config = clone / "kiln.toml"
    text, found = re.subn(r'(?m)^url = "file://\.kiln/artifacts".*$', f'url = "{store.as_uri()}"', config.read_text())
    assert found == 1, "the default kiln.toml's [artifacts] url changed: update this test"
    config.write_text(text + '\n[build.cache]\nremote = "artifacts"\n')
    git(clone, "commit", "-q", "-am", "one store for the team's workers, and its cache tier")


@pytest.fixture(scope="module")
def nightly(tmp_path_factory, prefect_env):
    base = tmp_path_factory.mktemp("nightly")
    clone = base / "kiln"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], check=True, timeout=300)
    _share_a_store(clone, base / "store")
    out = base / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.flows.cli", "nightly", "--config", str(clone / "kiln.toml"), "--out", str(out)],
        cwd=clone, env=prefect_env, capture_output=True, text=True, timeout=3000,
    )
    return out / "latest", proc, clone / ".kiln" / "index"


def test_nightly_exits_zero_and_prints_the_summary(nightly):
    out, proc, _ = nightly
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "manifest:" in proc.stdout and "index:" in proc.stdout
    # the ending fits one screen (40 rows of 120 columns) and names every variant's install command
    assert sum(max(1, -(-len(line) // 120)) for line in proc.stdout.splitlines()) <= 40, proc.stdout
    manifest = json.loads((out / "run.json").read_text())
    install, urls = manifest["info"]["install"], manifest["info"]["index_url"]
    # the default project publishes the combined index of its variant wheels: one uv command picks the
    # machine's variant, and `kiln which` names the wheel for any other environment
    combined = variant_index(urls, "wheel-variants")
    assert combined, urls
    command = install_command(combined, install)
    assert f"  install (uv picks this machine's variant): {command}\n" in proc.stdout, proc.stdout
    assert f"  any other environment: kiln which {combined} --python" in proc.stdout
    for variant in ("cu130", "rocm", "cpu"):  # every variant's row, and its own index's pip command
        row = next(line for line in proc.stdout.splitlines() if line.startswith(f"  {variant} "))
        assert " built " in row and variant_index(urls, variant).endswith(row.split()[-1]), row
        command = install_command(variant_index(urls, variant), install)
        assert f"  install {variant}: {command}\n" in proc.stdout, proc.stdout


def test_run_manifest_records_every_stage_and_artifact(nightly):
    out, _, _ = nightly
    manifest = json.loads((out / "run.json").read_text())
    stages = {unit["stage"] for unit in manifest["units"]}
    assert {"build", "test", "bench", "publish"} <= stages
    assert not [u for u in manifest["units"] if u["state"] == "failed"]
    assert manifest["run_id"] == out.resolve().name
    built = {u["variant"] for u in manifest["units"] if u["stage"] == "build" and u["state"] == "completed"}
    assert {"cu130", "rocm", "cpu"} <= built
    wheels = [a for a in manifest["artifacts"] if a["kind"] == "wheel"]
    assert {w["variant"] for w in wheels} == {"cu130", "rocm", "cpu"}
    for artifact in manifest["artifacts"]:
        assert sha256_file(out / artifact["path"]) == artifact["sha256"], artifact["path"]
    assert {u["id"]: u["state"] for u in manifest["units"] if u["suite"] == "kernels-gpu"} == {
        "test/kernels-gpu/cu130": "not_run", "test/kernels-gpu/rocm": "not_run"}  # no GPU here: never "passed"
    # the bundled library's distributed suite runs in every nightly (gloo on the CPU), against the cpu wheel
    distributed = {u["id"]: u for u in manifest["units"] if u["suite"] == "distributed"}
    assert {k: u["state"] for k, u in distributed.items()} == {"test/distributed/cpu": "completed"}
    assert distributed["test/distributed/cpu"]["message"].startswith("9 passed")
    # the coverage table (issue 45): every requested cell, its wheel (manylinux where it has binaries), its state
    coverage = {row["variant"]: row for row in manifest["info"]["coverage"]}
    assert {v: row["state"] for v, row in coverage.items()} == {"cu130": "untested", "rocm": "untested",
                                                                 "cpu": "tested"}
    assert "-py3-none-manylinux_2_" in coverage["cu130"]["wheel"] and coverage["cpu"]["wheel"].endswith("-any.whl")
    assert coverage["cu130"]["why"].startswith("kernels-gpu not run")


def test_index_links_resolve_and_hashes_match(nightly):
    _, _, index = nightly
    report = check_local_index(index)
    assert report.problems == []
    # each object once, linked from its channel's page and from its commit's (nightly/<variant>/commits/…)
    linked = sorted({p for p in report.files if p.suffix == ".whl"})
    assert all(report.files.count(p) == 2 for p in linked)
    wheels = [p.name for p in linked]
    local = [n for n in wheels if n.startswith("kiln_kernels-") and "+" in n]
    assert {n.split("+")[1].split("-")[0] for n in local} == {"cu130", "rocm", "cpu"}
    # the combined index (nightly/wheel-variants): every variant's PEP 825 variant wheel and the plain default
    combined = sorted(p.name for p in linked if p.parts[-4] == "wheel-variants" and p.name.startswith("kiln_kernels-"))
    assert [n.removesuffix(".whl").rsplit("-", 1)[-1] for n in combined] == ["null", "any", "cu130", "rocm"]
    # kiln-runtime (which the kernel wheels require) is published in every variant's index and the combined one
    assert len([n for n in wheels if n.startswith("kiln_runtime-")]) == 4


def test_pip_installs_the_cpu_wheel_from_the_index_into_a_fresh_venv(nightly, tmp_path):
    _, _, index = nightly
    simple = index / "nightly" / "cpu" / "simple"  # one PEP 503 root per channel and variant
    python = make_venv(tmp_path / "venv")
    # --ignore-installed: the venv sees the test environment's editable kiln-kernels, which pip would keep.
    # kiln-runtime (which kiln_kernels imports) must come from the same index: the run publishes it there.
    install = run([str(python), "-m", "pip", "install", "--no-deps", "--ignore-installed", "--index-url", simple.as_uri(),
                   "kiln-kernels", "kiln-runtime"], cwd=tmp_path)
    assert install.returncode == 0, install.stdout + install.stderr
    probe = run([str(python), "-c", "import kiln_kernels, torch; print(kiln_kernels.__file__)"], cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    assert str(tmp_path / "venv") in probe.stdout


def test_the_same_commit_built_again_and_witnessed_gives_the_nightlys_wheels_byte_for_byte(nightly, prefect_env,
                                                                                             tmp_path):
    """`kiln build --witness` of the nightly's commit, in its clone: the build is served by the nightly's caches,
    and the witness builds every native wheel again with every cache bypassed (cold: no head start, no compile
    worker warmed ahead, no compile cache). Every wheel is the nightly's bytes: a nightly once gave another cu130
    wheel than `kiln build` of its commit (one sm_100 cubin), and nothing noticed."""
    latest, _, _ = nightly
    clone = latest.parent.parent / "kiln"
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "kiln.flows.cli", "build", "--witness", "--config",
                           str(clone / "kiln.toml"), "--out", str(out)], cwd=clone, env=prefect_env,
                          capture_output=True, text=True, timeout=3000)
    run = RunManifest.load(out / "latest")
    units = {u.id: u for u in run.units}
    assert done.returncode == 0, {k: u.message for k, u in units.items() if u.state != "completed"}
    witnessed = units["build/witness"].message
    assert witnessed.startswith("witnessed: 3 wheels identical"), witnessed  # cu130, rocm and cpu
    nightly_run = RunManifest.load(latest)
    built = {a.variant: (run.root / a.path) for a in run.artifacts_of("wheel")}
    nightly_wheels = {a.variant: (nightly_run.root / a.path) for a in nightly_run.artifacts_of("wheel")}
    assert sorted(built) == sorted(nightly_wheels) == ["cpu", "cu130", "rocm"]
    for variant, wheel in built.items():
        assert wheel.name == nightly_wheels[variant].name
        assert wheel.read_bytes() == nightly_wheels[variant].read_bytes(), f"{variant}: not the nightly's bytes"


def test_a_second_fresh_worker_builds_nothing_runs_no_test_and_gives_the_same_wheels(nightly, prefect_env, tmp_path):
    """A second worker (a fresh clone of the nightly's commit, its own empty caches) runs the nightly against the
    first worker's store: every build unit comes from the shared tier, no test runs (each carried from the first
    worker's nightly: its inputs are unchanged), and every wheel is the first worker's bytes."""
    latest, _, _ = nightly
    first, clone = RunManifest.load(latest), tmp_path / "worker-b" / "kiln"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(latest.parent.parent / "kiln"), str(clone)],
                   check=True, timeout=300)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "kiln.flows.cli", "nightly", "--config", str(clone / "kiln.toml"),
                           "--out", str(out)], cwd=clone, env=prefect_env, capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    second = RunManifest.load(out / "latest")
    states = {u.id: u.cache for u in second.units if u.stage == "build" and u.cache}
    assert len(states) > 50 and set(states.values()) == {"hit"}, states
    shared = second.info["build_cache_shared"]
    assert shared["hits"] == len(states) and shared["misses"] == 0 and not shared["unreachable"], shared
    carried = f"carried from run {first.run_id}: its inputs are unchanged"
    outcomes = [t for report in sorted((out / "latest" / "tests").glob("*.cpu.json"))
                for t in json.loads(report.read_text())["tests"]]
    assert len(outcomes) > 100 and {(t["outcome"], t["message"]) for t in outcomes} == {("passed", carried)}
    wheels = {a.variant: second.root / a.path for a in second.artifacts_of("wheel")}
    assert sorted(wheels) == ["cpu", "cu130", "rocm"]
    for artifact in first.artifacts_of("wheel"):
        assert wheels[artifact.variant].read_bytes() == (first.root / artifact.path).read_bytes(), artifact.variant


def _build_for(clone: Path, out: Path, env: dict[str, str], target: str) -> tuple[int, RunManifest]:
    """`kiln build` of the clone with ``[build] manylinux = target`` (an uncommitted edit, undone after)."""
    config = clone / "kiln.toml"
    config.write_text(config.read_text().replace("[build]\n", f'[build]\nmanylinux = "{target}"\n', 1))
    try:
        done = subprocess.run([sys.executable, "-m", "kiln.flows.cli", "build", "--config", str(config), "--out",
                               str(out)], cwd=clone, env=env, capture_output=True, text=True, timeout=3000)
    finally:
        git(clone, "checkout", "kiln.toml")
    return done.returncode, RunManifest.load(out / "latest")


def test_the_default_projects_native_wheels_are_refused_for_manylinux_2_28_naming_symbols_and_meet_2_34(
        nightly, prefect_env, tmp_path):
    """This Debian 12 builder's glibc gives the default project's native wheels manylinux_2_34: a 2_28 target fails
    their units naming the symbol versions that push them newer; a 2_34 target tags them for it."""
    clone = nightly[0].parent.parent / "kiln"
    code, run = _build_for(clone, tmp_path / "old", prefect_env, "2_28")
    refused = {u.id: u.message for u in run.units if u.state == "failed"}
    assert code != 0 and refused, [(u.id, u.state) for u in run.units]
    assert all("do not meet the manylinux target 2_28" in m and "GLIBC_2." in m for m in refused.values()), refused
    code, run = _build_for(clone, tmp_path / "new", prefect_env, "2_34")
    assert code == 0, {u.id: u.message for u in run.units if u.state != "completed"}
    native = [a.path for a in run.artifacts_of("wheel") if not a.path.endswith("-any.whl")]
    assert native and all(p.endswith("-manylinux_2_34_x86_64.whl") for p in native), native


def _commit_and_run_nightly(clone: Path, out: Path, env: dict[str, str], message: str) -> dict[str, dict]:
    """Commit the clone's edits a minute after its last commit, run its nightly into ``out``; every test's outcome."""
    later = datetime.fromisoformat(git(clone, "log", "-1", "--format=%cI")) + timedelta(minutes=1)
    git(clone, "commit", "-q", "-am", message, when=later.isoformat())
    proc = subprocess.run([sys.executable, "-m", "kiln.flows.cli", "nightly", "--config", str(clone / "kiln.toml"),
                           "--out", str(out)], cwd=clone, env=env, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return {t["nodeid"]: t for report in sorted((out / "latest" / "tests").glob("*.cpu.json"))
            for t in json.loads(report.read_text())["tests"]}


def test_a_docs_only_commit_runs_no_test_and_one_kernel_and_one_test_file_rerun_only_theirs(nightly, prefect_env):
    """Two commits on the nightly's clone. A README edit: the next nightly runs no test and carries every test
    from the first nightly. Then one commit changing the quantization Triton kernel's module and one test file:
    the next nightly runs exactly the tests whose recorded inputs held that module (named below) and that file's
    tests, and carries the rest, still naming the first nightly. Last in this module: it moves the clone's commit."""
    latest, _, _ = nightly
    clone, first = latest.parent.parent / "kiln", RunManifest.load(latest)
    carried = f"carried from run {first.run_id}: its inputs are unchanged"
    (clone / "README.md").write_text((clone / "README.md").read_text() + "\nA line of documentation.\n")
    outcomes = _commit_and_run_nightly(clone, latest.parent, prefect_env, "documentation only")
    assert RunManifest.load(latest).run_id != first.run_id and len(outcomes) > 100
    assert {n: (t["outcome"], t["message"]) for n, t in outcomes.items()} == {
        n: ("passed", carried) for n in outcomes}
    kernel = clone / "kernels" / "kiln_kernels" / "_quant_tl.py"
    kernel.write_text(kernel.read_text() + "\n# a change to one Triton kernel's module\n")
    test_file = clone / DISTRIBUTED
    test_file.write_text(test_file.read_text() + "\n# a change to one test file\n")
    outcomes = _commit_and_run_nightly(clone, latest.parent, prefect_env, "one Triton kernel and one test file")
    ran = {n for n, t in outcomes.items() if t["message"] != carried}
    assert LAUNCH_IT <= ran and not ran & NEVER_IMPORT_IT, sorted(ran)
    assert {n for n in outcomes if n.startswith(f"{DISTRIBUTED}::")} <= ran  # the changed test file's tests
    assert {n.split("::")[0] for n in ran} == {QUANT, REGISTRY, LOADER, DISTRIBUTED}, sorted(ran)  # others carried
    assert len(ran) < len(outcomes) / 2 and all(t["outcome"] == "passed" for t in outcomes.values())
