"""The default project's cpu wheel: no GPU artifacts, installs, runs the torch and interpreter paths."""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kiln.tasks.build.stage import assemble_variant, prepare_build
from kiln.tasks.wheel.runtime_wheel import build_runtime_wheel

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

_PROBE = """
import json, os, torch, kiln_kernels as kernels
x = torch.randn(4, 64)
q, scale = kernels.per_token_quant(x)
ref = torch.round(x / (x.abs().amax(1, keepdim=True) / 127)).clamp(-127, 127).to(torch.int8)
print(json.dumps({"file": kernels.__file__, "interpret": os.environ.get("TRITON_INTERPRET", ""),
                  "max_diff": int((q.int() - ref.int()).abs().max())}))
"""


def test_cpu_wheel_of_the_default_project_installs_and_runs(tmp_path):
    setup = prepare_build(str(REPO / "kiln.toml"), "0.1.0.dev20261129", ["cpu"], cache_dir=str(tmp_path / "cache"))
    (variant,) = setup.plan.variants
    output = assemble_variant(setup, variant, {}, tmp_path / "out")
    wheel = next(path for path, kind in output.files if kind == "wheel")
    assert wheel.name == "kiln_kernels-0.1.0.dev20261129+cpu-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        assert not [n for n in archive.namelist() if "/_aot/" in n or n.endswith((".so", ".cubin", ".hsaco"))]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, timeout=60, capture_output=True, text=True).stdout.strip()
    Path(purelib, "parent.pth").write_text(site.getsitepackages()[0] + "\n")  # torch and triton, read-only
    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    runtime = build_runtime_wheel(tmp_path / "runtime")  # kiln_kernels imports kiln.runtime: its index carries it
    subprocess.run([uv, "pip", "install", "--offline", "--no-deps", "--python", str(python), str(wheel), str(runtime)],
                   check=True, timeout=300, capture_output=True)
    for interpret in ("", "1"):
        env = {"PATH": "/usr/bin:/bin", "TRITON_INTERPRET": interpret}
        out = subprocess.run([str(python), "-c", _PROBE], check=True, timeout=300, capture_output=True, text=True,
                             cwd=tmp_path, env=env)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["file"].startswith(str(venv)) and result["interpret"] == interpret
        assert result["max_diff"] <= 1  # rounding at .5 may differ by one step
