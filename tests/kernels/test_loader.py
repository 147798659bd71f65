"""kiln_kernels launches through Kiln's shipped loader (kiln.runtime.loader), reading its own _aot/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kiln.runtime.loader import Device, Loader
from kiln_kernels import _loader
from kiln_kernels.platform import Platform

H100 = Platform("cuda", "9.0", triton_version="3.6.0")
MI300 = Platform("hip", "gfx942", triton_version="3.6.0")


def test_the_package_uses_the_shipped_loader_on_its_own_aot_dir():
    assert isinstance(_loader.LOADER, Loader)
    assert _loader.LOADER.root == Path(_loader.__file__).resolve().parent / "_aot"


def test_a_platform_maps_to_the_loaders_device():
    assert _loader.device(H100) == Device("cuda", "9.0", "3.6.0", False)
    assert _loader.device(Platform("cpu", interpreter=True)) == Device("cpu", "", None, True)


def test_artifacts_built_for_sm90_are_found_and_rebuilt(tmp_path):
    """The build → manifest → loader chain without a GPU: everything short
    of the launch (the GPU tests and gpu_check.sh launch it)."""
    from kiln_kernels import registry, selfcheck

    # Compile in a clean process: once the Triton interpreter has run in a
    # process (as the other kernel tests do here), Triton's code generator
    # there is left partly patched and fails to compile.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from pathlib import Path; from kiln_kernels import selfcheck; "
            f"selfcheck.build(Path({str(tmp_path)!r}), 'cuda', '9.0')")
    subprocess.run([sys.executable, "-c", code], cwd=Path(selfcheck.__file__).parents[1], env=env,
                   check=True, timeout=300, capture_output=True)
    aot = Loader(tmp_path)
    for kernel, entry, name, _, _ in selfcheck.CHECKS:
        _, fn = registry.find_specialization(kernel, entry, name)
        pre = aot.precompiled(kernel, entry, name, fn, _loader.device(H100))
        assert pre is not None and pre.kernel.name == entry
        assert pre.aligned  # the data pointers at least
        assert aot.precompiled(kernel, entry, name, fn, _loader.device(MI300)) is None
