"""Per-variant wheels: valid RECORD, +variant version, metadata, installs in a fresh venv."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import shutil
import site
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from packaging.utils import parse_wheel_filename

import kiln.runtime
from kiln.core.errors import InvalidInputError
from kiln.tasks.project.config import load_config
from kiln.tasks.wheel.assemble import WheelInput, WheelStamp, build_wheel, platform_tag, wheel_filename
from tests.helpers.projects import copy_project


def _record_ok(archive: zipfile.ZipFile) -> dict[str, str]:
    """Check every RECORD row against the member's bytes; return name -> hash."""
    record_name = next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))
    rows = list(csv.reader(io.StringIO(archive.read(record_name).decode())))
    listed = {row[0]: row[1] for row in rows}
    assert set(listed) == set(archive.namelist())
    for name, value in listed.items():
        if name == record_name:
            assert value == ""
            continue
        data = archive.read(name)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert value == f"sha256={digest}", name
    return listed


@pytest.fixture
def tiny_wheels(tmp_path):
    config = load_config(copy_project("tiny", tmp_path))
    cubin = tmp_path / "b" / "9.0" / "add" / "add_kernel__fp32_b64.cubin"
    cubin.parent.mkdir(parents=True)
    cubin.write_bytes(b"\x7fELF-not-really")
    entry = {"kernel": "add", "entry": "add_kernel", "specialization": "fp32_b64", "arch": "9.0", "kind": "cubin",
             "path": "9.0/add/add_kernel__fp32_b64.cubin", "sha256": hashlib.sha256(cubin.read_bytes()).hexdigest(),
             "size": cubin.stat().st_size, "toolchain": {"triton": "3.9.0"}}
    stamp = WheelStamp.for_commit("c" * 40, 1764450423, {"triton": "3.9.0"}, environ={})
    gpu = build_wheel(config, "0.1.0.dev20261129+cu130", [WheelInput(cubin, entry["path"])], [entry],
                      tmp_path / "wheels", variant=config.variant("cu130"), stamp=stamp)
    cpu = build_wheel(config, "0.1.0.dev20261129+cpu", [], [], tmp_path / "wheels", variant=config.variant("cpu"),
                      stamp=stamp)
    return config, gpu, cpu, entry


def test_gpu_wheel_has_record_version_metadata_and_aot_manifest(tiny_wheels):
    config, gpu, _, entry = tiny_wheels
    name, version, _, tags = parse_wheel_filename(gpu.name)
    assert name == "tiny-kernels" and str(version) == "0.1.0.dev20261129+cu130"
    assert {t.platform for t in tags} != {"any"}
    with zipfile.ZipFile(gpu) as archive:
        listed = _record_ok(archive)
        assert "tinyk/_aot/9.0/add/add_kernel__fp32_b64.cubin" in listed
        assert "tinyk/add.py" in listed and not any("__pycache__" in n for n in listed)
        assert json.loads(archive.read("tinyk/_aot/manifest.json")) == [entry]
        metadata = archive.read("tiny_kernels-0.1.0.dev20261129+cu130.dist-info/METADATA").decode()
    assert "Name: tiny-kernels\n" in metadata and "Requires-Python: >=3.10\n" in metadata


def test_cpu_wheel_is_pure_and_has_no_gpu_artifacts(tiny_wheels):
    _, _, cpu, _ = tiny_wheels
    assert cpu.name == "tiny_kernels-0.1.0.dev20261129+cpu-py3-none-any.whl"
    with zipfile.ZipFile(cpu) as archive:
        _record_ok(archive)
        assert not [n for n in archive.namelist() if "/_aot/" in n]


def test_same_inputs_give_the_same_wheel_bytes_at_any_time(tiny_wheels, tmp_path):
    config, _, cpu, _ = tiny_wheels
    time.sleep(1.1)  # RECORD used to carry the clock's time: a second later, other bytes
    stamp = WheelStamp.for_commit("c" * 40, 1764450423, {"triton": "3.9.0"}, environ={})
    again = build_wheel(config, "0.1.0.dev20261129+cpu", [], [], tmp_path / "again", variant=config.variant("cpu"),
                        stamp=stamp)
    assert again.read_bytes() == cpu.read_bytes()
    with zipfile.ZipFile(again) as archive:
        assert {i.date_time for i in archive.infolist()} == {(2025, 11, 29, 21, 7, 2)}


def test_source_date_epoch_wins_over_the_commit_time():
    stamp = WheelStamp.for_commit("c" * 40, 1764450423, environ={"SOURCE_DATE_EPOCH": "1700000000"})
    assert stamp.epoch == 1700000000
    assert WheelStamp.for_commit("", 0, environ={}).epoch == 315532800  # zip's earliest time


def test_gpu_wheel_pins_the_triton_that_compiled_it_and_tags_honestly(tiny_wheels):
    _, gpu, cpu, _ = tiny_wheels
    assert gpu.name.endswith(f"-py3-none-{platform_tag()}.whl") and platform_tag().startswith("linux_")
    with zipfile.ZipFile(gpu) as archive:
        metadata = archive.read("tiny_kernels-0.1.0.dev20261129+cu130.dist-info/METADATA").decode()
        info = json.loads(archive.read("tiny_kernels-0.1.0.dev20261129+cu130.dist-info/kiln_build.json"))
    assert "Requires-Dist: triton==3.9.0\n" in metadata
    assert info["commit"] == "c" * 40 and info["toolchain"]["triton"] == "3.9.0"
    with zipfile.ZipFile(cpu) as archive:
        cpu_metadata = archive.read("tiny_kernels-0.1.0.dev20261129+cpu.dist-info/METADATA").decode()
    # The cpu wheel compiled nothing: it carries the project's declared triton, never the compiler's pin.
    assert "Requires-Dist: triton\n" in cpu_metadata and "triton==" not in cpu_metadata


def test_bad_names_are_refused():
    with pytest.raises(InvalidInputError, match="'not a version'"):
        wheel_filename("tiny", "not a version", "py3-none-any")
    with pytest.raises(InvalidInputError, match="'py3-none'"):
        wheel_filename("tiny", "1.0", "py3-none")
    with pytest.raises(InvalidInputError):
        from kiln.tasks.run.versioning import variant_version

        variant_version("0.1.0", "Bad-Name")


@pytest.mark.slow
def test_wheel_installs_and_imports_in_a_fresh_venv(tiny_wheels, tmp_path):
    _, gpu, _, entry = tiny_wheels
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # the registry imports triton and kiln.runtime: let the fresh venv see the parent's
    # packages, read-only (kiln-runtime by its import root: a .pth line does not
    # run the editable install's finder)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, timeout=60, capture_output=True, text=True).stdout.strip()
    runtime_root = Path(kiln.runtime.__file__).parents[2]
    Path(purelib, "parent.pth").write_text(f"{site.getsitepackages()[0]}\n{runtime_root}\n")
    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    subprocess.run([uv, "pip", "install", "--offline", "--no-deps", "--python", str(python), str(gpu)],
                   check=True, timeout=300, capture_output=True)
    probe = ("import json, pathlib, tinyk, tinyk.registry as r; "
             "root = pathlib.Path(tinyk.__file__).parent; "
             "print(json.dumps([str(root), [s.name for s in r.registry()], "
             "json.loads((root / '_aot' / 'manifest.json').read_text())]))")
    out = subprocess.run([str(python), "-c", probe], check=True, timeout=120, capture_output=True, text=True, cwd=tmp_path)
    root, kernels, manifest = json.loads(out.stdout)
    assert root.startswith(str(venv))
    assert kernels == ["add", "scale"] and manifest == [entry]
    assert (Path(root) / "_aot" / entry["path"]).read_bytes() == b"\x7fELF-not-really"


def test_vendored_libraries_and_data_are_kept_and_exclusions_warned(tmp_path, caplog):
    import logging

    config_path = copy_project("tiny", tmp_path)
    package = config_path.parent / "tinyk"
    (package / "lib").mkdir()
    (package / "lib" / "libvendor.so").write_bytes(b"\x7fELF vendored")
    (package / "data.bin").write_bytes(b"\x00\x01")
    (package / "scratch.tmp").write_text("local")
    (package / "_aot").mkdir()
    (package / "_aot" / "stale.cubin").write_bytes(b"old")
    config_path.write_text(config_path.read_text().replace('unit_timeout_s = 120', 'unit_timeout_s = 120\nexclude = ["*.tmp"]'))
    config = load_config(config_path)
    stamp = WheelStamp.for_commit("c" * 40, 1764450423, environ={})
    with caplog.at_level(logging.WARNING, logger="kiln.tasks.wheel.assemble"):
        cpu = build_wheel(config, "0.1.0+cpu", [], [], tmp_path / "wheels", variant=config.variant("cpu"), stamp=stamp)
    with zipfile.ZipFile(cpu) as archive:
        names = set(_record_ok(archive))
    assert {"tinyk/lib/libvendor.so", "tinyk/data.bin"} <= names
    assert "tinyk/scratch.tmp" not in names and "tinyk/_aot/stale.cubin" not in names
    assert "scratch.tmp" in caplog.text and "_aot/stale.cubin" in caplog.text
    # A wheel with a shared library is not pure, whatever the variant.
    assert cpu.name.endswith(f"-py3-none-{platform_tag()}.whl")


def test_a_stored_wheel_is_copied_when_its_members_are_unchanged(tmp_path, monkeypatch, caplog):
    """The build cache keeps each written wheel by its members: the same members give the stored
    bytes (no rewrite), changed members a new wheel, and a damaged copy is rewritten, never served."""
    import logging

    from kiln.tasks.build.cache import BuildCache
    from kiln.tasks.wheel import assemble as wheel_module

    stamp = WheelStamp.for_commit("c" * 40, 1764450423, environ={})
    members = [("pkg/__init__.py", b"x = 1\n"), ("pkg-1.0.dist-info/METADATA", b"Metadata-Version: 2.1\nName: pkg\n"
               b"Version: 1.0\n"), ("pkg-1.0.dist-info/WHEEL", b"Wheel-Version: 1.0\nTag: py3-none-any\n")]
    name, cache = "pkg-1.0-py3-none-any.whl", BuildCache(tmp_path / "cache")
    fresh = wheel_module.write_wheel(tmp_path / "plain", name, members, stamp).read_bytes()
    first = wheel_module.write_wheel(tmp_path / "a", name, members, stamp, cache=cache).read_bytes()
    assert first == fresh

    written = wheel_module._write_archive

    def must_not_write(*args):
        raise AssertionError("the wheel was written again although its members are unchanged")

    monkeypatch.setattr(wheel_module, "_write_archive", must_not_write)
    assert wheel_module.write_wheel(tmp_path / "b", name, members, stamp, cache=cache).read_bytes() == fresh
    with pytest.raises(AssertionError, match="written again"):  # other bytes, other key
        wheel_module.write_wheel(tmp_path / "c", name, [*members[:1], ("pkg/more.py", b"")], stamp, cache=cache)
    later = WheelStamp.for_commit("c" * 40, 1764450423 + 86400, environ={})
    with pytest.raises(AssertionError, match="written again"):  # another time stamp, other key
        wheel_module.write_wheel(tmp_path / "c", name, members, later, cache=cache)

    monkeypatch.setattr(wheel_module, "_write_archive", written)
    for obj in (tmp_path / "cache" / "objects").rglob("*"):
        if obj.is_file():
            obj.write_bytes(obj.read_bytes()[:-1] + b"!")  # bit rot in the stored copy
    with caplog.at_level(logging.WARNING, logger="kiln.tasks.build.cache"):
        again = wheel_module.write_wheel(tmp_path / "d", name, members, stamp, cache=cache).read_bytes()
    assert again == fresh and "build cache drift" in caplog.text
    assert wheel_module.write_wheel(tmp_path / "e", name, members, stamp, cache=cache).read_bytes() == fresh
