"""The fresh environment a run's tests use sees Kiln as installed here, whatever the working directory holds."""

from __future__ import annotations

import os
import subprocess

from kiln.tasks.testing import envs
from tests.helpers.wheelkit import make_wheel


def test_a_kiln_egg_info_in_the_working_directory_does_not_hide_the_installed_kiln(tmp_path, monkeypatch):
    # An in-tree build (`pip wheel .`) leaves kiln.egg-info in the checkout, which is on sys.path
    # under `python -m pytest`; it has no editable .pth, so it must not be what envs reads.
    stray = tmp_path / "checkout" / "kiln.egg-info"
    stray.mkdir(parents=True)
    (stray / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: kiln\nVersion: 0.1.0\n")
    monkeypatch.chdir(stray.parent)
    monkeypatch.syspath_prepend(str(stray.parent))
    wheel = make_wheel(tmp_path / "wheels", "probe-pkg", "1.0", module="probe_pkg")
    env = envs.make_env(tmp_path / "env", [wheel])
    probe = subprocess.run([str(env.python), "-P", "-c", "import probe_pkg, kiln.tasks.bench.measure, kiln.runtime.loader"],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert probe.returncode == 0, probe.stderr
