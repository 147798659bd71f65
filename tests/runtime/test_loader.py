"""kiln.runtime.loader: the shipped loader picks the artifact for the device, verifies it, or JITs once-warned."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest

from kiln.runtime import loader
from kiln.runtime.loader import Device, Loader

H100 = Device("cuda", "9.0", triton="3.6.0")
L4 = Device("cuda", "8.9", triton="3.6.0")
MI300 = Device("hip", "gfx942", triton="3.6.0")
SIGNATURE = {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}


def entry(arch, kind="cubin", spec="fp32_b64", path=None, **extra):
    row = {"kernel": "add", "entry": "add_kernel", "specialization": spec, "arch": arch, "kind": kind,
           "path": path or f"{arch}/add/{spec}.{kind}", "sha256": "0" * 64, "signature": SIGNATURE,
           "constexprs": {"BLOCK": 64}, "aligned": ["x_ptr"], "toolchain": {"triton": "3.6.0"}}
    return row | extra


def find(entries, device, spec="fp32_b64", root=None, tmp=None):
    arts = loader.parse_manifest(entries, root or tmp)
    art = loader.find_artifact(arts, "add", "add_kernel", spec, device)
    return None if art is None else art.arch


@pytest.mark.parametrize("archs, device, expected", [
    (["8.0", "9.0", "10.0"], H100, "9.0"),
    (["8.0", "8.6"], L4, "8.6"),              # highest lower minor of the same major
    (["9.0a"], H100, "9.0a"),
    (["8.0", "9.0a", "9.0"], H100, "9.0"),    # plain beats the a-suffixed one
    (["9.0a"], Device("cuda", "9.1"), None),  # an a-cubin runs on its own arch only
    (["10.0"], H100, None),                   # never a newer arch
    (["8.0"], H100, None),                    # never another major
    (["gfx942"], H100, None),
    (["gfx90a", "gfx942"], MI300, "gfx942"),  # ROCm: the exact target only
    (["gfx90a"], MI300, None),
    (["9.0"], Device("cpu"), None),
])
def test_the_best_artifact_for_the_device_is_chosen(archs, device, expected, tmp_path):
    kinds = ["hsaco" if a.startswith("gfx") else "cubin" for a in archs]
    assert find([entry(a, k) for a, k in zip(archs, kinds, strict=False)], device, tmp=tmp_path) == expected


def test_another_specialization_does_not_match(tmp_path):
    assert find([entry("9.0")], H100, spec="fp16_b64", tmp=tmp_path) is None


def test_a_manifest_path_may_not_leave_the_aot_dir(tmp_path):
    with pytest.raises(ValueError, match="leaves"):
        loader.parse_manifest([entry("9.0", path="../../evil.cubin")], tmp_path)


def test_a_malformed_manifest_is_refused_naming_the_entry(tmp_path):
    bad = entry("9.0")
    del bad["sha256"]
    with pytest.raises(ValueError, match=r"entry 0: .*sha256"):
        loader.parse_manifest([bad], tmp_path)
    with pytest.raises(ValueError, match="JSON list"):
        loader.parse_manifest({"entries": []}, tmp_path)


def test_shared_libraries_in_the_manifest_are_not_launch_candidates(tmp_path):
    rows = [entry("9.0"), {"kernel": "act", "entry": "lib.so", "specialization": "csrc", "arch": "9.0",
                           "kind": "shared-library", "path": "lib.so", "sha256": "1" * 64}]
    assert [a.kind for a in loader.parse_manifest(rows, tmp_path)] == ["cubin"]


def test_no_manifest_means_no_artifact(tmp_path):
    assert Loader(tmp_path).artifacts == ()


def _aot(tmp_path, rows, binary=b"cubin bytes"):
    for row in rows:
        path = tmp_path / row["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(binary)
    (tmp_path / "manifest.json").write_text(json.dumps(rows))
    return Loader(tmp_path)


def test_no_match_warns_once_and_falls_back(tmp_path, caplog):
    aot = Loader(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kiln.runtime.loader"):
        for _ in range(3):
            assert aot.precompiled("add", "add_kernel", "fp32_b64", object(), H100) is None
    assert len(caplog.records) == 1 and "Triton JIT" in caplog.text


def test_a_hash_mismatch_is_never_launched(tmp_path, caplog):
    aot = _aot(tmp_path, [entry("9.0")])
    with caplog.at_level(logging.WARNING, logger="kiln.runtime.loader"):
        assert aot.precompiled("add", "add_kernel", "fp32_b64", object(), H100) is None
    assert "sha256" in caplog.text and hashlib.sha256(b"cubin bytes").hexdigest() != "0" * 64


def test_an_artifact_from_another_triton_is_not_launched(tmp_path, caplog):
    aot = _aot(tmp_path, [entry("9.0", toolchain={"triton": "3.1.0"})])
    with caplog.at_level(logging.WARNING, logger="kiln.runtime.loader"):
        assert aot.precompiled("add", "add_kernel", "fp32_b64", object(), H100) is None
    assert "Triton 3.1.0" in caplog.text


def test_a_listed_but_missing_binary_falls_back(tmp_path, caplog):
    aot = Loader(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps([entry("9.0")]))
    with caplog.at_level(logging.WARNING, logger="kiln.runtime.loader"):
        assert aot.precompiled("add", "add_kernel", "fp32_b64", object(), H100) is None
    assert "missing" in caplog.text


def test_use_root_forgets_what_was_loaded(tmp_path):
    aot = Loader(tmp_path / "none")
    assert aot.artifacts == ()
    _aot(tmp_path / "built", [entry("9.0")])
    aot.use_root(tmp_path / "built")
    assert [a.arch for a in aot.artifacts] == ["9.0"]


def test_the_alignment_check_reads_pointers_and_ints():
    import torch

    base = torch.empty(64, dtype=torch.float32)
    assert loader.divisible_by_16((base, 7, 32), (0, 2))
    assert not loader.divisible_by_16((base[1:], 7, 32), (0, 2))  # 4-byte offset view
    assert not loader.divisible_by_16((base, 7, 32), (1,))
    assert loader.divisible_by_16((base[1:], 7), ())


def test_a_cpu_device_runs_the_jit_function_with_its_options():
    calls = []

    class FakeJit:  # stands in for an interpreted @triton.jit function (fault-free, no Triton needed)
        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append((grid, args, kw))

    from triton.runtime.interpreter import InterpretedFunction

    fake = FakeJit()
    fake.__class__ = type("Interp", (FakeJit, InterpretedFunction), {})
    Loader("/nonexistent").launch("add", "add_kernel", "fp32_b64", fake, (2,), (1, 2), {"BLOCK": 64},
                                  Device("cpu", interpreter=True), num_warps=4)
    assert calls == [((2,), (1, 2), {"BLOCK": 64, "num_warps": 4})]
