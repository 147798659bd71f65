"""An aarch64 wheel cross-built here runs on aarch64: installed in Debian's arm64 userland under qemu-user, its
extension imported by that userland's own CPython and its function checked against a Python reference.

Opt-in (KILN_TEST_AARCH64=1): it needs root (binfmt_misc, chroot), Debian's mirror and, the first time,
minutes to make the userland (kept in a cache folder afterwards: KILN_TEST_AARCH64_CACHE, default
~/.cache/kiln/aarch64-userland).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from kiln.tasks.build import cross
from kiln.tasks.testing import emulation

FIXTURE = Path(__file__).parents[1] / "fixtures" / "projects" / "crossdot"
AARCH64 = cross.target("aarch64")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(3600),  # the first run makes the userland: its emulated second stage took over 15 min here
    pytest.mark.skipif(os.environ.get("KILN_TEST_AARCH64") != "1",
                       reason="emulated aarch64 run: set KILN_TEST_AARCH64=1 (root, network, minutes the first time)"),
]

A, B = [1.5, -2.0, 3.25, 1e-3], [4.0, 0.5, -6.0, 1e3]
CHECK = f"""
import json, platform, sys, sysconfig
import crossdot, crossdot._fast
print(json.dumps({{"machine": platform.machine(), "suffix": sysconfig.get_config_var("EXT_SUFFIX"),
                  "file": crossdot._fast.__file__, "dot": crossdot.dot({A!r}, {B!r}),
                  "python": "%d.%d" % sys.version_info[:2]}}))
"""


def test_the_cross_built_wheel_runs_under_an_emulated_aarch64_cpython(tmp_path: Path) -> None:
    missing = emulation.missing_tools() + ([] if cross.compiler(AARCH64) else ["aarch64-linux-gnu-gcc"])
    if missing:
        pytest.skip(f"cannot emulate aarch64 here: no {', '.join(missing)}")
    project = Path(shutil.copytree(FIXTURE, tmp_path / "crossdot"))
    built = cross.cross_build(project, tmp_path / "linux", AARCH64, cross.default_cache_dir(), timeout_s=300)
    wheel = cross.manylinux_tagged(built, tmp_path / "wheels", AARCH64, target_glibc="2_28")
    cache = Path(os.environ.get("KILN_TEST_AARCH64_CACHE") or cross.default_cache_dir().parent / "aarch64-userland")
    with emulation.aarch64_binfmt():
        root = emulation.userland(cache)
        site = emulation.installed(root, wheel, "crossdot")
        report = json.loads(emulation.run_python(root, CHECK, [site]).strip().splitlines()[-1])
    assert not (emulation.BINFMT / emulation.ENTRY).exists()  # the registration was undone
    assert report["machine"] == "aarch64"
    assert report["python"] == "3.11"  # bookworm's CPython, the wheel's cp311
    assert report["file"].endswith("_fast.cpython-311-aarch64-linux-gnu.so")
    assert report["dot"] == sum(a * b for a, b in zip(A, B, strict=True))  # the same IEEE doubles, in order
