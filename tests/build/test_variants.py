"""PEP 825 variant wheels from the build, the index-level variants file, and what installers choose from them."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kiln.core.errors import InvalidInputError
from kiln.release.index.variants import (
    VARIANT_SCHEMA,
    merge_variants,
    read_wheel_variant,
    variants_json_name,
    wheel_variant_label,
    wheels_variants,
)
from kiln.tasks.build.stage import assemble_variant, prepare_build
from kiln.tasks.project.config import load_config
from kiln.tasks.wheel.assemble import WheelInput, WheelStamp, build_wheel
from kiln.tasks.wheel.variants import cuda_lower_bound, sm_arch_values, write_variant_wheels
from tests.helpers.projects import copy_project

VERSION = "0.1.0.dev20261129"


def _build(tmp_path: Path) -> tuple[dict[str, Path], list[Path]]:
    """The tiny project's +cu130, +rocm and +cpu wheels (a fake cubin each GPU one) and their variant wheels."""
    config = load_config(copy_project("tiny", tmp_path))
    cubin = tmp_path / "b" / "9.0" / "add" / "add_kernel__fp32_b64.cubin"
    cubin.parent.mkdir(parents=True)
    cubin.write_bytes(b"\x7fELF-not-really")
    entry = {"kernel": "add", "entry": "add_kernel", "specialization": "fp32_b64", "arch": "9.0", "kind": "cubin",
             "path": "9.0/add/add_kernel__fp32_b64.cubin", "sha256": hashlib.sha256(cubin.read_bytes()).hexdigest(),
             "size": cubin.stat().st_size, "toolchain": {"triton": "3.9.0"}}
    stamp = WheelStamp.for_commit("c" * 40, 1764450423, {"triton": "3.9.0"}, environ={})
    wheels, variant_wheels = {}, []
    for name in ("cu130", "rocm", "cpu"):
        variant = config.variant(name)
        binaries, entries = ([WheelInput(cubin, entry["path"])], [entry]) if variant.backend != "cpu" else ([], [])
        wheels[name] = build_wheel(config, f"{VERSION}+{name}", binaries, entries, tmp_path / "wheels",
                                   variant=variant, stamp=stamp)
        variant_wheels += write_variant_wheels(config, variant, wheels[name], tmp_path / "variant-wheels", stamp)
    return wheels, variant_wheels


@pytest.fixture
def built(tmp_path):
    return _build(tmp_path)


def _members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def test_each_variant_gets_a_labelled_wheel_of_the_public_version_and_cpu_the_null_and_default(built):
    wheels, variant_wheels = built
    assert [p.name for p in variant_wheels] == [
        f"tiny_kernels-{VERSION}-{wheels['cu130'].name.split('-', 2)[2].removesuffix('.whl')}-cu130.whl",
        f"tiny_kernels-{VERSION}-{wheels['rocm'].name.split('-', 2)[2].removesuffix('.whl')}-rocm.whl",
        f"tiny_kernels-{VERSION}-py3-none-any-null.whl",
        f"tiny_kernels-{VERSION}-py3-none-any.whl",
    ]
    assert [wheel_variant_label(p.name) for p in variant_wheels] == ["cu130", "rocm", "null", None]
    cu130 = read_wheel_variant(variant_wheels[0].name, variant_wheels[0])
    assert cu130["$schema"] == VARIANT_SCHEMA
    assert cu130["default-priorities"] == {"namespace": ["nvidia", "amd"]}
    assert cu130["providers"]["nvidia"]["plugin-api"] == "nvidia_variant_provider.plugin:NvidiaVariantPlugin"
    # tiny's cu130 requests 8.0 and 9.0; no nvcc built it, so the CUDA bound is its cuNNN name's
    assert cu130["variants"] == {"cu130": {"nvidia": {"cuda_version_lower_bound": ["13.0"],
                                                      "sm_arch": ["80_real", "90_real"]}}}
    rocm = read_wheel_variant(variant_wheels[1].name, variant_wheels[1])
    assert rocm["variants"] == {"rocm": {"amd": {"gfx_arch": ["gfx942"]}}}
    assert read_wheel_variant(variant_wheels[2].name, variant_wheels[2])["variants"] == {"null": {}}


def test_a_variant_wheel_holds_the_same_contents_under_the_public_version(built):
    wheels, variant_wheels = built
    local, variant = _members(wheels["cu130"]), _members(variant_wheels[0])
    old, new = f"tiny_kernels-{VERSION}+cu130.dist-info/", f"tiny_kernels-{VERSION}.dist-info/"
    assert {n for n in local if not n.startswith(old)} == {n for n in variant if not n.startswith(new)}
    assert all(variant[n] == data for n, data in local.items() if not n.startswith(old))
    assert variant[new + "METADATA"] == local[old + "METADATA"].replace(b"+cu130", b"")
    assert variant[new + "kiln_build.json"] == local[old + "kiln_build.json"]
    assert variant[new + "WHEEL"] == local[old + "WHEEL"]
    sbom = json.loads(variant[new + "sboms/kiln.cdx.json"])
    assert sbom["metadata"]["component"]["version"] == VERSION
    assert set(variant) - {n.replace(old, new) for n in local} == {new + "variant.json"}
    # the plain default wheel is the null variant without its variant.json
    null, default = _members(variant_wheels[2]), _members(variant_wheels[3])
    assert set(null) - set(default) == {new + "variant.json"}
    assert all(default[n] == null[n] for n in default if not n.endswith("RECORD"))


def test_two_builds_give_identical_variant_wheels(tmp_path):
    first = _build(tmp_path / "a")[1]
    second = _build(tmp_path / "b")[1]
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]


def test_cuda_bound_and_sm_arch_values():
    config = load_config(Path(__file__).parents[1] / "fixtures" / "projects" / "tiny" / "kiln.toml")
    cu130 = config.variant("cu130")
    assert cuda_lower_bound(cu130, {"nvcc": "12.8.93"}) == "12.8"  # the toolkit that built it wins
    assert cuda_lower_bound(cu130, {"nvcc": "absent"}) == "13.0"
    assert cuda_lower_bound(config.variant("rocm"), {}) is None
    assert sm_arch_values(("8.0", "9.0a", "12.0+PTX", "8.0")) == ["80_real", "90a_real", "120_real", "120_virtual"]


def _doc(variants: dict, namespaces=("nvidia",)) -> dict:
    return {"$schema": VARIANT_SCHEMA, "default-priorities": {"namespace": list(namespaces)}, "variants": variants}


def test_merge_only_adds_labels_and_refuses_a_conflicting_definition(built):
    _, variant_wheels = built
    merged = wheels_variants(variant_wheels)
    assert list(merged["variants"]) == ["cu130", "null", "rocm"]
    assert merged["providers"]["amd"]["plugin-api"] == "amd_variant_provider.plugin:AMDVariantPlugin"
    # publishing again, or another run's wheels of the same build, only adds
    again = merge_variants(merged, [read_wheel_variant(p.name, p) for p in variant_wheels[:1]])
    assert again == merged
    cu126 = {**merged, "variants": {"cu126": {"nvidia": {"cuda_version_lower_bound": ["12.6"]}}}}
    assert list(merge_variants(merged, [cu126])["variants"]) == ["cu126", "cu130", "null", "rocm"]
    changed = {**merged, "variants": {"cu130": {"nvidia": {"cuda_version_lower_bound": ["12.8"]}}}}
    with pytest.raises(InvalidInputError, match="variant label 'cu130' is already defined"):
        merge_variants(merged, [changed])
    with pytest.raises(InvalidInputError, match="default-priorities"):
        merge_variants(_doc({"a": {}}), [_doc({"b": {}}, ("nvidia", "amd"))])
    with pytest.raises(InvalidInputError, match=r"namespaces \['x86_64'\] are missing"):
        merge_variants(None, [_doc({"a": {"x86_64": {"level": ["3"]}}})])
    with pytest.raises(InvalidInputError, match="variant label 'CU130'"):
        merge_variants(None, [_doc({"CU130": {}})])
    assert variants_json_name("Tiny-Kernels", "0.1.0.dev20261129") == "tiny_kernels-0.1.0.dev20261129-variants.json"


def _page(index: Path, files: list[Path], variants: dict) -> str:
    """A PEP 503 project page of ``files`` and the variants file (Kiln's index writer lists no variant files yet)."""
    page = index / "tiny-kernels"
    page.mkdir(parents=True)
    names = []
    for path in files:
        shutil.copy(path, page / path.name)
        names.append(path.name)
    name = variants_json_name("tiny-kernels", VERSION)
    (page / name).write_bytes(json.dumps(variants, indent=2, sort_keys=True).encode() + b"\n")
    names.append(name)
    anchors = "".join(f'<a href="{n}#sha256={hashlib.sha256((page / n).read_bytes()).hexdigest()}">{n}</a><br>\n'
                      for n in names)
    (page / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{anchors}</body></html>\n")
    (index / "index.html").write_text('<!DOCTYPE html>\n<html><body><a href="tiny-kernels/">tiny-kernels</a>'
                                      "</body></html>\n")
    return index.as_uri() + "/"


def _installed(uv: str, tmp_path: Path, url: str, label: str, env: dict[str, str], *preview: str) -> str:
    """Install tiny-kernels (no deps) into a fresh venv with uv; the installed wheel's variant label, or ''."""
    venv = tmp_path / f"venv-{label}"
    subprocess.run([uv, "venv", "-q", "--no-config", str(venv)], check=True, timeout=60)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "NV_VARIANT_", "VIRTUAL_ENV"))}
    subprocess.run([uv, "pip", "install", "-q", "--no-config", "--no-cache", *preview, "--no-deps",
                    "--python", str(venv / "bin" / "python"), "--index-url", url, "tiny-kernels"],
                   check=True, timeout=120, env={**clean, **env})
    return _label(venv)


def _label(venv: Path) -> str:
    info = next((venv / "lib").glob("python*/site-packages/tiny_kernels-*.dist-info"))
    assert info.name == f"tiny_kernels-{VERSION}.dist-info"
    variant = info / "variant.json"
    return next(iter(json.loads(variant.read_text())["variants"])) if variant.exists() else ""


@pytest.mark.slow
def test_uv_chooses_the_variant_the_machine_supports_and_pip_the_default(built, tmp_path):
    """The proof, on a GPU-less machine: the tiny project's variant wheels, null wheel, default wheel and
    variants file on one file:// page; installs use ``--no-deps`` (tiny requires kiln-runtime and triton,
    which say nothing about the choice), each into a fresh venv, the choice read from the installed
    ``*.dist-info/variant.json``.

    What uv 0.13 does (found here; see "Variant wheels" in docs/getting-started.md): its NVIDIA provider is told the
    machine's CUDA driver and GPU by ``NV_VARIANT_PROVIDER_FORCE_CUDA_DRIVER_VERSION`` and
    ``NV_VARIANT_PROVIDER_FORCE_SM_ARCH``; ``UV_CUDA_DRIVER_VERSION`` (the kernel driver, for
    ``--torch-backend``) does not reach it. uv vendors no AMD provider: it skips the ``amd`` namespace
    ("Skipping unsupported wheel variant provider `amd_variant_provider.plugin:AMDVariantPlugin`") whatever
    ``UV_AMD_GPU_ARCHITECTURE`` says, so the rocm wheel is never chosen and the null variant is installed.
    """
    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    _, variant_wheels = built
    url = _page(tmp_path / "index", variant_wheels, wheels_variants(variant_wheels))
    preview = ("--preview-features", "wheel-variants")
    cuda13 = {"NV_VARIANT_PROVIDER_FORCE_CUDA_DRIVER_VERSION": "13.0", "NV_VARIANT_PROVIDER_FORCE_SM_ARCH": "9.0"}
    assert _installed(uv, tmp_path, url, "none", {}, *preview) == "null"
    assert _installed(uv, tmp_path, url, "cuda13", cuda13, *preview) == "cu130"
    # an 8.6 GPU runs the 8.0 cubins; a CUDA 12.8 driver is below the wheel's CUDA 13.0 bound
    assert _installed(uv, tmp_path, url, "sm86", {**cuda13, "NV_VARIANT_PROVIDER_FORCE_SM_ARCH": "8.6"},
                      *preview) == "cu130"
    assert _installed(uv, tmp_path, url, "cuda12", {**cuda13, "NV_VARIANT_PROVIDER_FORCE_CUDA_DRIVER_VERSION": "12.8"},
                      *preview) == "null"
    assert _installed(uv, tmp_path, url, "kmd", {"UV_CUDA_DRIVER_VERSION": "580.65.06"}, *preview) == "null"
    assert _installed(uv, tmp_path, url, "gfx942", {"UV_AMD_GPU_ARCHITECTURE": "gfx942"}, *preview) == "null"
    # without the preview uv, like pip, installs the wheel without a label
    assert _installed(uv, tmp_path, url, "nopreview", cuda13) == ""
    venv = tmp_path / "venv-pip"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-cache-dir", "--no-deps", "--isolated", "--index-url", url, "tiny-kernels"],
                   check=True, timeout=120)
    assert _label(venv) == ""


def test_assembling_a_variant_records_its_variant_wheels_beside_its_wheel(tmp_path):
    config_path = copy_project("tiny", tmp_path)
    setup = prepare_build(str(config_path), VERSION, ["cpu"], cache_dir=str(tmp_path / "cache"))
    (variant,) = setup.plan.variants
    output = assemble_variant(setup, variant, {}, tmp_path / "out")
    kinds = [(path.parent.name, path.name, kind) for path, kind in output.files]
    assert kinds[:3] == [("wheels", f"tiny_kernels-{VERSION}+cpu-py3-none-any.whl", "wheel"),
                         ("variant-wheels", f"tiny_kernels-{VERSION}-py3-none-any-null.whl", "variant-wheel"),
                         ("variant-wheels", f"tiny_kernels-{VERSION}-py3-none-any.whl", "variant-wheel")]


def test_a_variants_file_that_is_not_an_object_is_refused_by_name():
    from kiln.core.errors import InvalidInputError
    from kiln.release.index.variants import merge_variants

    for raw in ("x", [1]):
        with pytest.raises(InvalidInputError, match="published variants file: variant metadata must be a JSON object"):
            merge_variants(raw, [])
