"""The publish flow records what its summary states: held-back variants, the pinned hint, the version warning.

One real Prefect flow run (the session's test server) publishing a run record to
a local target, with a ``file://`` extra index that holds a higher release.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest, Unit
from kiln.flows.publish import publish_flow
from kiln.flows.report.summary import render_text
from kiln.tasks.install_hint import CHECK_ENV
from tests.helpers.runkit import make_record
from tests.helpers.wheelkit import make_wheel

KILN_TOML = """
[project]
package = "demo"
distribution = "demo"
version = "1.0"
source = "src"
registry = "demo.registry:registry"

[[variants]]
name = "cu130"
backend = "cuda"
archs = ["9.0"]

[[variants]]
name = "cpu"
backend = "cpu"
archs = []

[publish]
default_target = "local"
extra_index_urls = ["{extra}"]
publish_untested = false

[publish.targets.local]
url = "file://{{out}}/index"

[permissions.publish-nightly]
read = ["nightly/"]
write = ["nightly/"]
credentials = {{ ambient = true }}
"""


@pytest.mark.slow
def test_the_publish_flow_holds_back_an_untested_variant_and_pins_the_hint_below_an_extra_release(
        prefect_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHECK_ENV, "on")  # the extra index is a local directory: nothing leaves this machine
    extra = tmp_path / "pypi" / "simple"
    wheel = make_wheel(extra / "demo", "demo", "2.0").name
    (extra / "demo" / "index.html").write_text(f'<a href="{wheel}">{wheel}</a>\n')
    (tmp_path / "src").mkdir()
    config_path = tmp_path / "kiln.toml"
    config_path.write_text(KILN_TOML.format(extra=extra.as_uri()))
    out = tmp_path / "run"
    run = make_record(config_path, out, {"cu130": [("demo", "1.0+cu130")], "cpu": [("demo", "1.0+cpu")]},
                      [Unit("test/kernels/cu130", "test", "completed", variant="cu130", suite="kernels")])
    state = publish_flow(config_path=str(config_path), out=str(out), run_id=run.run_id, return_state=True)
    assert state.is_completed(), state.message
    manifest = RunManifest.load(run.view)
    units = {u.id: u for u in manifest.units if u.stage == "publish"}
    assert units["publish/cpu"].state == "skipped"
    assert "no suite covers cpu, and kiln.toml [publish] publish_untested = false" in units["publish/cpu"].message
    assert not (out / "index" / "nightly" / "cpu").exists()
    text = render_text(manifest)
    assert text.splitlines()[1].startswith("VERSION BELOW AN EXTRA INDEX: demo 1.0 sorts below release 2.0")
    index = f"{(out / 'index').resolve().as_uri()}/nightly/cu130/simple/"
    assert (f"install: env PIP_CONFIG_FILE=/dev/null pip install --isolated --index-url {index} --no-deps demo==1.0+cu130 && "
            f"env PIP_CONFIG_FILE=/dev/null pip install --isolated --index-url {index} --extra-index-url {extra.as_uri()} demo==1.0+cu130") in text
    assert "SKIPPED   1 unit skipped: not published: no suite covers cpu" in text


@pytest.mark.slow
def test_a_bench_stage_with_no_wheel_for_its_variant_is_not_run_with_the_reason(prefect_server, tmp_path: Path) -> None:
    from kiln.flows.bench import bench_flow
    from kiln.tasks.bench.harness import bench_variant
    from kiln.tasks.project.config import load_config

    (tmp_path / "src").mkdir()
    config_path = tmp_path / "kiln.toml"
    config_path.write_text(KILN_TOML.format(extra=(tmp_path / "pypi").as_uri()))
    variant = bench_variant(load_config(config_path))  # cpu here; cu130 on a CUDA machine
    out = tmp_path / "run"
    failed = [Unit(f"build/{v}/-/demo/pep517", "build", "failed", variant=v, message="CompileError: exit 1")
              for v in ("cu130", "cpu")]
    run = make_record(config_path, out, {}, failed)
    state = bench_flow(config_path=str(config_path), out=str(out), run_id=run.run_id, store_history=False,
                       return_state=True)
    assert state.is_completed(), state.message
    unit = {u.id: u for u in RunManifest.load(run.view).units}[f"bench/{variant}"]
    assert (unit.state, unit.message) == ("not_run", f"not run: run {run.run_id} has no {variant} wheel to benchmark: "
                                                     f"its build failed (build/{variant}/-/demo/pep517)")
