"""Ahead-of-time compile units: real Triton in spawned workers, ELF arch checked."""

from __future__ import annotations

import struct

import pytest

from kiln.core.errors import CompileError, InfrastructureError
from kiln.core.fsutil import sha256_file
from kiln.tasks.build.aot import check_elf_arch, elf_arch
from kiln.tasks.build.cache import BuildCache
from kiln.tasks.build.pool import WorkerPool, WorkerTimeout
from kiln.tasks.build.stage import prepare_build, worker_config
from kiln.tasks.build.units import CompileContext, build_unit, unit_record
from tests.helpers.projects import copy_project


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    triton_cache = tmp_path_factory.mktemp("triton-cache")
    # sandboxed workers: the tests' own directories are the project they read and the outputs they write
    base = str(tmp_path_factory.getbasetemp())
    with WorkerPool(2, {"TRITON_INTERPRET": None, "TRITON_CACHE_DIR": str(triton_cache)}, read=(base,),
                    write=(base,)) as pool:
        yield pool


def _env(setup, tmp_path, pool):
    return CompileContext(worker_config(setup), tmp_path / "out" / "build", BuildCache(tmp_path / "cache"), pool,
                    120, setup.plan.toolchain)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return prepare_build(str(copy_project("tiny", tmp_path_factory.mktemp("tiny"))), "0.1.0", None)


@pytest.mark.parametrize(("unit_id", "elf"), [
    ("build/cu130/9.0/add/fp32_b64", "sm_90"),
    ("build/rocm/gfx942/add/fp32_b64", "gfx942"),
])
def test_compile_writes_a_binary_for_the_planned_arch(tiny, tmp_path, pool, unit_id, elf):
    unit = next(u for u in tiny.plan.units if u.id == unit_id)
    result = build_unit(unit, _env(tiny, tmp_path, pool))
    binary = next(p for p in result.files if p.suffix in (".cubin", ".hsaco"))
    assert elf_arch(binary.read_bytes()) == elf
    assert binary.with_suffix(".json").is_file()  # Triton's metadata travels with the binary
    (entry,) = result.entries
    assert entry["sha256"] == sha256_file(binary) and entry["size"] == binary.stat().st_size
    assert entry["arch"] == unit.arch and entry["kind"] == binary.suffix[1:]
    assert result.cache == "miss"
    assert build_unit(unit, _env(tiny, tmp_path, pool)).cache == "hit"


def test_failed_compile_names_kernel_arch_spec_and_compiler_message(tmp_path, pool):
    setup = prepare_build(str(copy_project("broken", tmp_path)), "0.1.0", ["cu130"])
    unit = next(u for u in setup.plan.units if u.id == "build/cu130/8.0/fp8cast/fp32_b64")
    with pytest.raises(CompileError) as info:
        build_unit(unit, _env(setup, tmp_path, pool))
    message = str(info.value)
    for needle in ("'fp8cast'", "'fp32_b64'", "cuda 8.0", "fp8e4nv not supported"):
        assert needle in message
    row = unit_record(unit, info.value)
    assert row.state == "failed" and row.arch == "8.0" and row.kernel == "fp8cast"
    assert "fp8e4nv not supported" in row.message
    # the same kernel builds for 9.0: one failure stays one failure
    ok = next(u for u in setup.plan.units if u.id == "build/cu130/9.0/fp8cast/fp32_b64")
    assert build_unit(ok, _env(setup, tmp_path, pool)).cache == "miss"


def test_an_entry_whose_fn_is_not_a_triton_kernel_fails_its_unit_saying_so(tmp_path, pool):
    """A registry entry whose function lacks @triton.jit is the package's mistake, named as one: a failed unit
    (CompileError), not an error of Kiln's worker."""
    config = copy_project("tiny", tmp_path)
    kernel = config.parent / "tinyk" / "add.py"
    kernel.write_text(kernel.read_text().replace("@triton.jit\n", "", 1))
    setup = prepare_build(str(config), "0.1.0", ["cu130"])
    unit = next(u for u in setup.plan.units if u.id == "build/cu130/9.0/add/fp32_b64")
    with pytest.raises(CompileError, match=r"kernel 'add' entry 'add_kernel': its fn 'add_kernel' is not a Triton"
                                           r" kernel; decorate it with @triton.jit"):
        build_unit(unit, _env(setup, tmp_path, pool))


def test_a_gfx_target_the_compiler_does_not_know_fails_its_unit_naming_it(tmp_path, pool):
    config = copy_project("tiny", tmp_path)
    config.write_text(config.read_text().replace('archs = ["gfx942"]', 'archs = ["gfx942", "gfx999"]'))
    registry = config.parent / "tinyk" / "registry.py"
    registry.write_text(registry.read_text().replace('"hip": ("gfx942",)', '"hip": ("gfx942", "gfx999")'))
    setup = prepare_build(str(config), "0.1.0", ["rocm"])
    unit = next(u for u in setup.plan.units if u.id == "build/rocm/gfx999/add/fp32_b64")
    with pytest.raises(CompileError, match=r"'add' specialization 'fp32_b64' for hip gfx999: Triton failed"):
        build_unit(unit, _env(setup, tmp_path, pool))


def _elf(machine: int, flags: int, abi: int = 8) -> bytes:
    header = bytearray(64)
    header[:4] = b"\x7fELF"
    header[4], header[8] = 2, abi
    struct.pack_into("<H", header, 18, machine)
    struct.pack_into("<I", header, 48, flags)
    return bytes(header)


@pytest.mark.parametrize(("data", "expected"), [
    (_elf(190, 0x500550, abi=7), "sm_80"),
    (_elf(190, 0x9005A04), "sm_90"),
    (_elf(190, 0x9007802), "sm_120"),
    (_elf(224, 0x54C), "gfx942"),
    (_elf(224, 0x53F), "gfx90a"),
])
def test_elf_arch_reads_cubin_and_hsaco_headers(data, expected):
    assert elf_arch(data) == expected


def _hsaco(mach: int, triple: str) -> bytes:
    """An AMDGPU code object whose metadata note names the target ``triple`` (in a msgpack blob)."""
    owner = b"AMDGPU\0"
    desc = b"\x82\xaa.vgpr_count\x06\xadamdhsa.target\xd9" + bytes([len(triple)]) + triple.encode() + b"\xaeamdhsa.version"
    note = struct.pack("<III", len(owner), len(desc), 32) + owner + b"\0" * (-len(owner) % 4) + desc
    note += b"\0" * (-len(note) % 4)
    header = bytearray(_elf(224, 0x500 | mach))
    shoff = 64 + len(note)
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HH", header, 0x3A, 64, 2)
    sections = bytearray(128)  # the null section, then the note
    struct.pack_into("<IIQQQQ", sections, 64, 0, 7, 0, 0, 64, len(note))
    return bytes(header) + note + bytes(sections)


@pytest.mark.parametrize(("mach", "triple", "target"), [
    (0x4A, "amdgpu11.51-amd-amdhsa-unknown-gfx1151", "gfx1151"),  # what Triton 3.9's LLVM writes
    (0x7E, "amdgcn-amd-amdhsa--gfx1250", "gfx1250"),  # 0x7e: newer than any table, the note still names it
    (0x4C, "amdgcn-amd-amdhsa--gfx942:sramecc+:xnack-", "gfx942"),
])
def test_hsaco_target_is_read_from_its_metadata_note_for_any_gfx(mach, triple, target):
    assert elf_arch(_hsaco(mach, triple)) == target
    check_elf_arch(_hsaco(mach, triple), "hip", target, "unit x")


def test_wrong_or_garbled_binary_is_a_compile_error():
    with pytest.raises(CompileError, match="is for sm_80, the plan asked for sm_90"):
        check_elf_arch(_elf(190, 0x500550, abi=7), "cuda", "9.0", "unit x")
    with pytest.raises(CompileError, match="not a 64-bit ELF"):
        elf_arch(b"garbage")
    with pytest.raises(CompileError, match="ELF machine 62"):
        elf_arch(_elf(62, 0))


def test_hung_worker_is_killed_at_its_deadline_and_replaced(pool):
    with pytest.raises(WorkerTimeout, match="deadline") as info:
        pool.call("time:sleep", 60, timeout=1)
    assert info.value.escalation in ("sigterm", "sigkill") and "process group ended by" in info.value.ladder
    assert pool.call("math:sqrt", 16, timeout=60) == 4.0


def test_dead_worker_is_a_retryable_infrastructure_error(pool):
    with pytest.raises(InfrastructureError) as info:
        pool.call("os:_exit", 3, timeout=60)
    assert info.value.retryable
    assert pool.call("math:sqrt", 9, timeout=60) == 3.0


def test_drift_found_by_a_unit_raises_retryable_and_the_retry_rebuilds(tiny, tmp_path, pool):
    from kiln.core.errors import CacheDriftError

    unit = next(u for u in tiny.plan.units if u.id == "build/cu130/8.0/add/fp32_b64")
    env = _env(tiny, tmp_path, pool)
    first = build_unit(unit, env)
    objects = [p for p in (tmp_path / "cache" / "objects").rglob("*") if p.is_file()]
    cubin = next(p for p in objects if p.read_bytes() == first.files[0].read_bytes())
    cubin.write_bytes(b"\0" * cubin.stat().st_size)  # same size, other bytes
    with pytest.raises(CacheDriftError) as info:
        build_unit(unit, env)
    assert info.value.retryable and env.events == [f"{unit.id}: {info.value}"]
    retried = build_unit(unit, env)  # what Prefect's retry does
    assert retried.cache == "miss" and retried.files[0].read_bytes() == first.files[0].read_bytes()


def test_cached_results_serve_hits_as_build_unit_does_and_leave_misses_and_drift_to_it(tiny, tmp_path, pool):
    from kiln.tasks.build.units import cached_results

    units = [u for u in tiny.plan.units if u.id in ("build/cu130/8.0/add/fp32_b64", "build/cu130/9.0/add/fp32_b64",
                                                    "build/cu130/8.0/scale/fp32_b64")]
    env = _env(tiny, tmp_path, pool)
    built = {u.id: build_unit(u, env) for u in units[:2]}  # the third is never built: a miss
    served = cached_results(units, env)
    assert sorted(served) == sorted(built) and {r.cache for r in served.values()} == {"hit"}
    for uid, result in served.items():
        assert result.files == built[uid].files and result.entries == built[uid].entries
    cubin = next(p for p in (tmp_path / "cache" / "objects").rglob("*")
                 if p.is_file() and p.read_bytes() == built[units[0].id].files[0].read_bytes())
    cubin.write_bytes(b"\0" * cubin.stat().st_size)
    assert cached_results(units, env) == {}  # the drifted batch is invalidated: both of its units compile again
    assert len(env.events) == 1 and env.events[0].startswith(f"{units[0].id}: ")
