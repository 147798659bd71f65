"""Finding a shipped artifact for the device; JIT fallback when none fits."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest

from kernels import _loader
from kernels.platform import Platform

H100 = Platform("cuda", "9.0", triton_version="3.6.0")
L4 = Platform("cuda", "8.9", triton_version="3.6.0")
MI300 = Platform("hip", "gfx942", triton_version="3.6.0")


def entry(arch, kind="cubin", spec="bf16_i8_b512", path=None):
    return {"kernel": "per_token_quant", "entry": "per_token_quant_kernel", "specialization": spec,
            "arch": arch, "kind": kind, "path": path or f"{arch}/{spec}.{kind}", "sha256": "0" * 64}


def find(entries, plat, spec="bf16_i8_b512", root=None):
    arts = _loader.parse_manifest(entries, root or _loader.AOT_DIR)
    art = _loader.find_artifact(arts, "per_token_quant", "per_token_quant_kernel", spec, plat)
    return None if art is None else art.arch


@pytest.mark.parametrize("archs, plat, expected", [
    (["8.0", "9.0", "10.0"], H100, "9.0"),
    (["8.0", "8.6"], L4, "8.6"),              # highest lower minor of the same major
    (["9.0a"], H100, "9.0a"),
    (["8.0", "9.0a", "9.0"], H100, "9.0"),    # plain beats the a-suffixed one
    (["9.0a"], Platform("cuda", "9.1"), None),  # an a-cubin runs on its own arch only
    (["10.0"], H100, None),                   # never a newer arch
    (["8.0"], H100, None),                    # never another major
    (["gfx942"], H100, None),
])
def test_cuda_arch_matching(archs, plat, expected):
    kinds = ["hsaco" if a.startswith("gfx") else "cubin" for a in archs]
    assert find([entry(a, k) for a, k in zip(archs, kinds)], plat) == expected


def test_rocm_needs_exact_arch():
    entries = [entry("gfx90a", "hsaco"), entry("gfx942", "hsaco")]
    assert find(entries, MI300) == "gfx942"
    assert find([entry("gfx90a", "hsaco")], MI300) is None


def test_other_specialization_does_not_match():
    assert find([entry("9.0")], H100, spec="fp32_i8_b512") is None


def test_manifest_path_may_not_leave_the_aot_dir(tmp_path):
    with pytest.raises(ValueError, match="leaves"):
        _loader.parse_manifest([entry("9.0", path="../../evil.cubin")], tmp_path)


def test_malformed_manifest_entry_is_rejected(tmp_path):
    bad = entry("9.0")
    del bad["sha256"]
    with pytest.raises(ValueError, match="sha256"):
        _loader.parse_manifest([bad], tmp_path)
    with pytest.raises(ValueError, match="JSON list"):
        _loader.parse_manifest({"entries": []}, tmp_path)


def test_no_manifest_means_no_artifact(tmp_path):
    assert _loader.manifest(tmp_path) == ()


def test_no_match_warns_once_and_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(_loader, "manifest", lambda root=None: ())
    monkeypatch.setattr(_loader, "_compiled", {})
    monkeypatch.setattr(_loader, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="kiln.kernels.loader"):
        for _ in range(3):
            assert _loader.aot_kernel("per_token_quant", "per_token_quant_kernel", "bf16_i8_b512", H100) is None
    assert len(caplog.records) == 1 and "Triton JIT" in caplog.text


def test_hash_mismatch_is_never_launched(tmp_path, monkeypatch, caplog):
    (tmp_path / "9.0").mkdir()
    (tmp_path / "9.0" / "bf16_i8_b512.cubin").write_bytes(b"cubin bytes")
    (tmp_path / "manifest.json").write_text(json.dumps([entry("9.0")]))
    arts = _loader.manifest.__wrapped__(tmp_path)
    monkeypatch.setattr(_loader, "manifest", lambda root=None: arts)
    monkeypatch.setattr(_loader, "_compiled", {})
    monkeypatch.setattr(_loader, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="kiln.kernels.loader"):
        assert _loader.aot_kernel("per_token_quant", "per_token_quant_kernel", "bf16_i8_b512", H100) is None
    assert "sha256" in caplog.text
    assert hashlib.sha256(b"cubin bytes").hexdigest() != "0" * 64


def test_artifacts_built_for_sm90_are_found_and_rebuilt(tmp_path):
    """The build → manifest → loader chain without a GPU: everything short
    of the launch (the GPU tests and gpu_check.sh launch it)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from kernels import selfcheck

    # Compile in a clean process: once the Triton interpreter has run in a
    # process (as the other kernel tests do here), Triton's code generator
    # there is left partly patched and fails to compile.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from pathlib import Path; from kernels import selfcheck; "
            f"selfcheck.build(Path({str(tmp_path)!r}), 'cuda', '9.0')")
    subprocess.run([sys.executable, "-c", code], cwd=Path(selfcheck.__file__).parents[1], env=env,
                   check=True, timeout=300, capture_output=True)
    try:
        _loader.use_root(tmp_path)
        for kernel, entry, name, _, _ in selfcheck.CHECKS:
            assert _loader.artifact_path(kernel, entry, name, H100).is_file()
            pre = _loader.aot_kernel(kernel, entry, name, H100)
            assert pre is not None and pre.kernel.name == entry
            assert pre.aligned  # the data pointers at least
            assert _loader.aot_kernel(kernel, entry, name, MI300) is None
    finally:
        _loader.use_root(_loader.AOT_DIR)


def test_artifact_from_another_triton_is_not_launched(tmp_path, monkeypatch, caplog):
    row = entry("9.0") | {"toolchain": {"triton": "3.1.0", "torch": "2.5.0"}}
    arts = _loader.parse_manifest([row], tmp_path)
    monkeypatch.setattr(_loader, "manifest", lambda root=None: arts)
    monkeypatch.setattr(_loader, "_compiled", {})
    monkeypatch.setattr(_loader, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="kiln.kernels.loader"):
        assert _loader.aot_kernel("per_token_quant", "per_token_quant_kernel", "bf16_i8_b512", H100) is None
    assert "Triton 3.1.0" in caplog.text


def test_alignment_check_reads_pointers_and_ints():
    import torch

    from kernels._launch import divisible_by_16

    base = torch.empty(64, dtype=torch.float32)
    assert divisible_by_16((base, 7, 32), (0, 2))
    assert not divisible_by_16((base[1:], 7, 32), (0, 2))  # 4-byte offset view
    assert not divisible_by_16((base, 7, 32), (1,))
    assert divisible_by_16((base[1:], 7), ())
