"""A Triton unit's bytes do not depend on which compile worker built it: one started and warmed ahead by a
command's head start, or a fresh pool's started under a longer temporary directory, for a copy of the project
at another path (tasks/build/aot.py, tasks/build/sparepool.py). Real workers and Triton's own ptxas; no GPU."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kiln.tasks.build import aot, sparepool
from tests.helpers.waiting import until

REPO = Path(__file__).resolve().parents[2]
_ADDR_NO_RANDOMIZE = 0x0040000
# ptxas 13.1's sm_100 cubin of this specialization changed from one run to the next (a few swapped registers)
# with its address layout and with the length of the file names it was given.
UNIT = {"kernel": "router_logits", "entry": "router_logits_kernel", "specialization": "bf16_t64_e64_d64",
        "backend": "cuda", "arch": "10.0"}
WARMED = "'triton.compiler' in __import__('sys').modules and 'kiln_kernels.registry' in __import__('sys').modules"

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="address-space personality is Linux's")


def _child_personality() -> int:
    out = subprocess.run(["cat", "/proc/self/personality"], check=True, capture_output=True, text=True, timeout=30)
    return int(out.stdout, 16)


@linux_only
def test_programs_started_during_a_compile_run_without_address_randomisation_and_the_worker_keeps_its_own():
    before = _child_personality()
    with aot.fixed_address_layout():
        assert _child_personality() & _ADDR_NO_RANDOMIZE
    assert _child_personality() == before


def test_ptxas_files_go_under_the_pools_cache_not_the_workers_tmpdir(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    before = tempfile.gettempdir()
    with aot.compiler_scratch():
        with tempfile.NamedTemporaryFile(suffix=".ptx") as handle:
            assert Path(handle.name).parent == tmp_path / "cache" / "tmp"
    assert tempfile.gettempdir() == before


def test_a_pools_directory_has_one_path_length_wherever_the_command_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "a-much-longer-temporary-directory"))
    (tmp_path / "a-much-longer-temporary-directory").mkdir()
    first = sparepool.new_pool(1, tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", None)
    second = sparepool.new_pool(1, tmp_path)
    try:
        assert len(first.triton_cache.name) == len(second.triton_cache.name)
    finally:
        first.close()
        second.close()


def _copy_default_project(dest: Path) -> str:
    """The default project's kiln.toml, its package and the paths its kiln.toml names, copied to ``dest``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so", "build")
    for tree in ("kernels", "tests/kernels", "tests/distributed", "tests/bench"):
        shutil.copytree(REPO / tree, dest / tree, ignore=ignore)
    (dest / "release" / "index").mkdir(parents=True)
    shutil.copy2(REPO / "release" / "index" / "pins.json", dest / "release" / "index" / "pins.json")
    shutil.copy2(REPO / "kiln.toml", dest / "kiln.toml")
    return str((dest / "kiln.toml").resolve())


def _compile(pool: sparepool.CompilePool, config: str) -> bytes:
    result = pool.pool.call("kiln.tasks.build.aot:compile_in_worker", {"config": config, **UNIT}, 300)
    aot.check_elf_arch(result["binary"], "cuda", "10.0", "router_logits")
    binary: bytes = result["binary"]
    return binary


@pytest.mark.slow
def test_warmed_and_fresh_workers_give_the_same_cubin_for_any_copy_of_the_project(tmp_path, monkeypatch):
    here = _copy_default_project(tmp_path / "a")
    there = _copy_default_project(tmp_path / "somewhere" / "else" / "entirely")
    sparepool.prestart(here, 1, 300)
    warmed = sparepool.take(here, 1)
    assert warmed is not None
    try:
        # the worker imported Triton's compiler and the registry before it was asked for a unit
        assert until(lambda: warmed.pool.call("builtins:eval", WARMED, 300), bool, 120) is True
        expected = _compile(warmed, here)
    finally:
        warmed.close()
    # a fresh pool started by a command whose temporary directory is longer: its workers' TMPDIRs are too
    longer = tmp_path / "a-command-with-a-longer-temporary-directory"
    longer.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(longer))
    for config in (here, there):
        fresh = sparepool.new_pool(1, Path(config).parent)
        try:
            assert _compile(fresh, config) == expected, config
        finally:
            fresh.close()
