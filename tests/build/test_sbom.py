"""Every wheel Kiln writes carries a CycloneDX SBOM (PEP 770): valid against the schema, naming the commit,
the variant and the toolchain, listing every binary with the sha256 of the member the wheel holds."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator

from kiln.tasks.project.config import load_config
from kiln.tasks.wheel.assemble import WheelInput, WheelStamp, build_wheel, write_wheel
from kiln.tasks.wheel.rewheel import rewrite_wheel
from kiln.tasks.wheel.sbom import is_binary
from tests.helpers.projects import copy_project

STAMP = WheelStamp.for_commit("c" * 40, 1764450423, {"triton": "3.9.0", "nvcc": "13.0"}, environ={})


def _sbom(wheel: Path) -> tuple[dict, dict[str, bytes]]:
    with zipfile.ZipFile(wheel) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    found = [name for name in members if name.endswith(".dist-info/sboms/kiln.cdx.json")]
    assert len(found) == 1, sorted(members)
    text = members[found[0]].decode()
    assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(text) is None  # the CycloneDX 1.6 schema
    return json.loads(text), members


def _properties(sbom: dict) -> dict[str, str]:
    return {p["name"]: p["value"] for p in sbom["properties"]}


def test_a_gpu_wheels_sbom_lists_each_binary_with_the_hash_of_the_member_it_holds(tmp_path):
    config = load_config(copy_project("tiny", tmp_path))
    cubin = tmp_path / "b" / "add_kernel__fp32_b64.cubin"
    cubin.parent.mkdir(parents=True)
    cubin.write_bytes(b"\x7fELF-not-really")
    wheel = build_wheel(config, "0.1.0.dev20261129+cu130", [WheelInput(cubin, "9.0/add/add_kernel__fp32_b64.cubin")],
                        [], tmp_path / "wheels", variant=config.variant("cu130"), stamp=STAMP)
    sbom, members = _sbom(wheel)
    binaries = {c["name"]: c["hashes"][0]["content"] for c in sbom["components"] if c["type"] == "file"}
    held = {name: hashlib.sha256(data).hexdigest() for name, data in members.items() if is_binary(name)}
    assert binaries == held == {"tinyk/_aot/9.0/add/add_kernel__fp32_b64.cubin":
                                hashlib.sha256(b"\x7fELF-not-really").hexdigest()}
    assert _properties(sbom) == {"kiln:commit": "c" * 40, "kiln:variant": "cu130", "kiln:backend": "cuda",
                                 "kiln:archs": "8.0,9.0"}
    tools = {t["name"]: t["version"] for t in sbom["metadata"]["tools"]["components"]}
    assert tools == {"nvcc": "13.0", "triton": "3.9.0"}
    assert sbom["metadata"]["component"]["version"] == "0.1.0.dev20261129+cu130"
    assert sbom["metadata"]["timestamp"].startswith("2025-11-29T21:07:03")  # the stamp's time, not the clock's


def test_a_cpu_wheels_sbom_holds_no_binary_and_two_builds_write_the_same_bytes(tmp_path):
    config = load_config(copy_project("tiny", tmp_path))
    first = build_wheel(config, "0.1.0+cpu", [], [], tmp_path / "a", variant=config.variant("cpu"), stamp=STAMP)
    again = build_wheel(config, "0.1.0+cpu", [], [], tmp_path / "b", variant=config.variant("cpu"), stamp=STAMP)
    sbom, members = _sbom(first)
    assert not sbom.get("components") and _properties(sbom)["kiln:archs"] == "none"
    assert sbom == _sbom(again)[0] and first.read_bytes() == again.read_bytes()


def test_a_backend_built_wheel_gets_the_sbom_of_what_it_ships(tmp_path):
    """pep517: the backend's wheel is rewritten with Kiln's version; its own library is listed, hashed."""
    library = b"\x7fELF-a-torch-extension"
    members = {"plaincuda/__init__.py": b"x = 1\n", "plaincuda/_C.cpython-311-x86_64-linux-gnu.so": library,
               "plaincuda-1.0.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: plaincuda\nVersion: 1.0.0\n",
               "plaincuda-1.0.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: setuptools\n"
                                                  b"Root-Is-Purelib: false\nTag: py3-none-linux_x86_64\n"}
    built = write_wheel(tmp_path / "built", "plaincuda-1.0.0-py3-none-linux_x86_64.whl", sorted(members.items()),
                        STAMP)
    config = load_config(copy_project("plaincuda", tmp_path))
    wheel = rewrite_wheel(config, config.variant("cpu"), "1.0.0.dev5+cpu", built, [], [], tmp_path / "out", STAMP)
    sbom, held = _sbom(wheel)
    assert "plaincuda-1.0.0.dev5+cpu.dist-info/sboms/kiln.cdx.json" in held
    assert [(c["name"], c["hashes"][0]["content"]) for c in sbom["components"]] == [
        ("plaincuda/_C.cpython-311-x86_64-linux-gnu.so", hashlib.sha256(library).hexdigest())]


def test_a_stored_sbom_is_the_bytes_a_fresh_one_has_and_any_input_changes_its_key(tmp_path):
    from kiln.tasks.build.cache import BuildCache
    from kiln.tasks.wheel.sbom import wheel_sbom

    variant = load_config(copy_project("tiny", tmp_path)).variant("cu130")
    members = [("tinyk/_aot/8.0/add/a.cubin", b"\x7fELF cubin"), ("tinyk/__init__.py", b"x = 1\n")]
    cache = BuildCache(tmp_path / "cache")

    def sbom(**change: object) -> bytes:
        args: dict = {"distribution": "tinyk", "version": "1.0+cu130", "variant": variant, "commit": "c" * 40,
                      "epoch": 1764450423, "toolchain": STAMP.toolchain, "members": members} | change
        return wheel_sbom(**args, cache=cache)

    fresh = wheel_sbom("tinyk", "1.0+cu130", variant, "c" * 40, 1764450423, STAMP.toolchain, members)
    assert sbom() == fresh and sbom() == fresh  # stored by the first, read back by the second
    assert len(list((tmp_path / "cache" / "entries" / "sbom").glob("*.json"))) == 1
    changed = [sbom(commit="d" * 40), sbom(version="1.1+cu130"), sbom(epoch=1764450424),
               sbom(toolchain=(("triton", "3.9.1"),)), sbom(members=[("tinyk/_aot/8.0/add/a.cubin", b"\x7fELF other")]),
               sbom(variant=variant.model_copy(update={"archs": ("9.0",)}))]
    assert len({fresh, *changed}) == 1 + len(changed)
    assert len(list((tmp_path / "cache" / "entries" / "sbom").glob("*.json"))) == 1 + len(changed)
