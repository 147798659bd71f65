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


def test_an_environment_asked_for_by_two_shards_at_once_is_made_once_and_shared(tmp_path):
    import threading

    from kiln.tasks.testing.envs import TestEnv, made_once

    started, release, calls = threading.Event(), threading.Event(), []

    def make() -> TestEnv:  # stands for make_env: slow, so the second shard asks while the first makes it
        calls.append(threading.current_thread().name)
        started.set()
        assert release.wait(timeout=60)
        return TestEnv(tmp_path / "env", tmp_path / "env" / "bin" / "python", ("pkg.whl",))

    got: dict[str, TestEnv] = {}
    first = threading.Thread(target=lambda: got.setdefault("first", made_once(tmp_path / "env", make)), name="first")
    first.start()
    assert started.wait(timeout=60)
    second = threading.Thread(target=lambda: got.setdefault("second", made_once(tmp_path / "env", make)),
                              name="second")
    second.start()
    release.set()
    first.join(timeout=60)
    second.join(timeout=60)
    assert calls == ["first"] and got["first"] is got["second"]
    assert made_once(tmp_path / "other", lambda: TestEnv(tmp_path / "other", tmp_path, ())) is not got["first"]
