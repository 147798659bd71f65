"""Wheels identical on any worker (invariant 8): two clones of one commit at paths of different length, built
cold, give byte-identical wheels for every variant, the default project's and a ``pep517`` project's; and the
flags and directories that make a project's own build independent of where it runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import zipfile
from datetime import datetime
from fnmatch import fnmatch
from pathlib import Path

import pytest

from kiln.core.errors import CompileError
from kiln.core.manifest import RunManifest
from kiln.tasks.build import stagedir
from kiln.tasks.build.reproducible import commit_time, path_maps, reproducible_environ
from kiln.tasks.project.config import Backend
from kiln.tasks.wheel.assemble import ZIP_EPOCH
from kiln.tasks.wheel.manylinux import EXCLUDES, most_compatible
from tests.helpers.cuda_torch import link_shared_envs, shared_cuda_torch_envs
from tests.helpers.gitrepo import COMMIT_TIME, git, git_project, init_repo

REPO = Path(__file__).resolve().parents[2]
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
MAPS = [("/w/clone-with-a-long-name/.kiln/cache/envs/k", "/kiln/build-env"), ("/tmp/kiln-pep517-0/ab", "/kiln/build"),
        ("/tmp/kiln-pep517-0/ab/src", ".")]


def test_the_maps_are_appended_to_every_compilers_flags_and_keep_the_users_own():
    user = {"CFLAGS": "-O2 -g", "NVCC_APPEND_FLAGS": "--use_fast_math", "LDFLAGS": "-L/opt/lib"}
    env = reproducible_environ(user, MAPS, 1764536823)
    own = "-ffile-prefix-map=/tmp/kiln-pep517-0/ab/src=."
    assert env["CFLAGS"].startswith("-O2 -g -ffile-prefix-map=") and env["CFLAGS"].endswith(own)
    assert env["CXXFLAGS"].startswith("-ffile-prefix-map=") and env["CXXFLAGS"].endswith(own)
    assert env["LDFLAGS"].startswith("-L/opt/lib ") and own in env["HIPCC_COMPILE_FLAGS_APPEND"]
    nvcc = env["NVCC_APPEND_FLAGS"].split()
    assert nvcc[:2] == ["--use_fast_math", "--objdir-as-tempdir"] and nvcc[-1] == f"-Xcompiler={own}"
    assert len([f for f in nvcc if f.startswith("-Xcompiler=-ffile-prefix-map=")]) == len(MAPS)
    assert env["SOURCE_DATE_EPOCH"] == "1764536823" and env["PYTHONHASHSEED"] == "0"
    assert user == {"CFLAGS": "-O2 -g", "NVCC_APPEND_FLAGS": "--use_fast_math", "LDFLAGS": "-L/opt/lib"}


def test_an_epoch_or_hash_seed_the_build_sets_itself_wins():
    env = reproducible_environ({"SOURCE_DATE_EPOCH": "1700000000", "PYTHONHASHSEED": "7"}, MAPS, 1764536823)
    assert (env["SOURCE_DATE_EPOCH"], env["PYTHONHASHSEED"]) == ("1700000000", "7")


def test_a_directory_inside_another_is_mapped_after_it_and_a_link_by_both_spellings(tmp_path):
    work = tmp_path / "work"
    (work / "src").mkdir(parents=True)
    (tmp_path / "envs-real" / "k").mkdir(parents=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "envs").symlink_to(tmp_path / "envs-real")
    maps = path_maps(work / "src", work, tmp_path / "cache" / "envs" / "k")
    # gcc and clang apply the last map that matches: the source's own map must follow its build directory's.
    assert [old for old, _ in maps] == sorted((old for old, _ in maps), key=len)
    found = dict(maps)
    assert found[str(work / "src")] == "." and found[str(work)] == "/kiln/build"
    assert found[str(tmp_path / "cache" / "envs" / "k")] == found[str(tmp_path / "envs-real" / "k")] == "/kiln/build-env"
    if sys.prefix != sys.base_prefix:
        assert found[sys.prefix] == "/kiln/python"


def test_a_path_no_compiler_can_map_is_a_clear_error():
    with pytest.raises(CompileError, match=r"cannot map the build path '/w/a=b'.*contains '=' or ','"):
        reproducible_environ({}, [("/w/a=b", ".")], 1764536823)


def test_the_epoch_is_the_commit_time_of_the_checkout_and_the_zip_epoch_outside_git(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "a.txt").write_text("a\n")
    init_repo(repo, when=COMMIT_TIME)
    assert commit_time(repo) == int(datetime.fromisoformat(COMMIT_TIME).timestamp())
    plain = tmp_path / "plain"
    plain.mkdir()
    assert commit_time(plain) == ZIP_EPOCH


def test_a_fixed_build_directory_is_held_by_one_build_at_a_time_and_removed_after(tmp_path):
    base = tmp_path / "tmp"
    base.mkdir()
    inside, released = threading.Event(), threading.Event()
    order: list[str] = []

    def first() -> None:
        with stagedir.fixed_dir("pep517", "k1", 60, base=base) as path:
            (path / "half-written").write_text("x")
            order.append("first in")
            inside.set()
            released.wait(60)
            order.append("first out")

    holder = threading.Thread(target=first)
    holder.start()
    assert inside.wait(60)
    waiter = threading.Thread(target=lambda: _second(base, order))
    waiter.start()
    released.set()
    holder.join(60)
    waiter.join(60)
    assert order == ["first in", "first out", "second in: []"]
    assert not (base / f"kiln-pep517-{os.getuid()}" / "k1").exists()


def _second(base: Path, order: list[str]) -> None:
    with stagedir.fixed_dir("pep517", "k1", 60, base=base) as path:
        order.append(f"second in: {sorted(p.name for p in path.iterdir())}")


def test_a_build_directory_held_past_the_deadline_is_a_clear_error(tmp_path):
    with stagedir.fixed_dir("pep517", "k2", 60, base=tmp_path) as held:
        with pytest.raises(CompileError, match=r"another build held .*k2\.lock past the deadline"), \
                stagedir.fixed_dir("pep517", "k2", 0.2, base=tmp_path):
            pass
        assert held.is_dir()


@pytest.mark.parametrize("name", ["", "../x", "a/b", "a b"])
def test_a_build_directory_name_that_is_not_plain_is_refused(tmp_path, name):
    with pytest.raises(CompileError, match="is not a plain name"), stagedir.fixed_dir("pep517", name, 1, base=tmp_path):
        pass
    assert list(tmp_path.iterdir()) == []


# --- two clones, cold builds ---------------------------------------------------------------------------------

def _clones(origin: Path, tmp_path: Path) -> list[Path]:
    """Two clones of ``origin``'s HEAD at paths of different length, as two scale-out workers would have them."""
    clones = [tmp_path / "w1", tmp_path / "worker-two-with-a-much-longer-path" / "checkouts" / "w2"]
    for clone in clones:
        clone.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "clone", "--quiet", str(origin), str(clone)], check=True, timeout=120,
                       capture_output=True)
    return clones


def _build(clone: Path, out: Path) -> dict[str, Path]:
    """A cold build of every variant (its own build cache, its own out dir); {variant: wheel}.

    ``kiln build`` in a process of its own, as a worker runs it: loading a clone's registry imports its
    package, and the default project's (kiln_kernels) must not replace the test session's own."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    done = subprocess.run([sys.executable, "-m", "kiln.flows.cli", "build", "--config", str(clone / "kiln.toml"),
                           "--out", str(out)], env=env, cwd=clone, capture_output=True, text=True, timeout=3000)
    views = [d for d in out.iterdir() if d.is_dir() and not d.is_symlink()]
    assert len(views) == 1, (views, done.stdout[-3000:], done.stderr[-3000:])
    run = RunManifest.load(views[0])
    assert done.returncode == 0, {u.id: u.message for u in run.units if u.state != "completed"}
    return {a.variant: run.root / a.path for a in run.artifacts_of("wheel")}


def _members(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as archive:
        return {info.filename: archive.read(info) for info in archive.infolist()}


def _assert_identical(first: dict[str, Path], second: dict[str, Path], clones: list[Path]) -> None:
    assert sorted(first) == sorted(second)
    for variant in first:
        a, b = first[variant], second[variant]
        assert a.name == b.name
        members_a, members_b = _members(a), _members(b)
        for members in (members_a, members_b):
            leaked = {n for n, data in members.items() for c in clones if str(c).encode() in data}
            assert not leaked, f"{variant}: members naming a clone's path: {sorted(leaked)}"
        differing = sorted(n for n in {*members_a, *members_b} if members_a.get(n) != members_b.get(n))
        assert not differing, f"{variant}: members that differ between the clones: {differing}"
        assert a.read_bytes() == b.read_bytes(), f"{variant}: same members, different zip bytes"


def _assert_manylinux(wheel: Path, backend: Backend) -> str:
    """``wheel`` carries a ``manylinux_2_*`` tag that ``auditwheel show`` confirms (its glibc symbols allow
    that tag; the only libraries it would want grafted are the backend's excluded ones), and no library of
    torch, CUDA or ROCm is inside it; returns the tag's platform."""
    platform = wheel.name.removesuffix(".whl").rsplit("-", 1)[1]
    assert platform.startswith("manylinux_2_"), wheel.name
    grafted = [n for n in _members(wheel) if ".libs/" in n
               or any(fnmatch(n.rsplit("/", 1)[-1], p) for p in {*EXCLUDES["cuda"], *EXCLUDES["hip"]})]
    assert not grafted, f"{wheel.name} carries {grafted}"
    done = subprocess.run([sys.executable, "-m", "auditwheel", "show", "--json", str(wheel)], capture_output=True,
                          text=True, timeout=300)
    report = json.loads(done.stdout)
    if not [n for n in _members(wheel) if ".so" in n]:  # device code only: not a platform wheel to auditwheel
        assert platform == most_compatible() and "error" in report, report
        return platform
    assert report["sym_tag"] == platform, report
    assert all(any(fnmatch(lib, p) for p in EXCLUDES[backend]) for lib in report["external_libs"]), report
    return platform


def _default_project(dest: Path) -> Path:
    """The repository's default project (kiln.toml, kernels/ and what kiln.toml names, as tracked) committed in a fresh repository; its
    cu130 and rocm arch lists cut to one arch each (CI's time), the same edit in the one commit both clones take."""
    paths = ["kiln.toml", "kernels", "release/index/pins.json", "tests/kernels", "tests/distributed", "tests/bench"]
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", *paths], check=True, timeout=60,
                             capture_output=True).stdout.decode().split("\0")
    for name in filter(None, tracked):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    config = dest / "kiln.toml"
    text = config.read_text()
    text, cuda = re.subn(r'archs = \["8\.0", [^]]*\]', 'archs = ["8.0"]', text, count=1)
    text, rocm = re.subn(r'archs = \["gfx90a", [^]]*\]', 'archs = ["gfx90a"]', text, count=1)
    assert cuda == rocm == 1, "the default kiln.toml's cu130/rocm arch lists changed: update this test"
    config.write_text(text)
    init_repo(dest)
    return dest


@pytest.mark.slow
@needs_nvcc
@pytest.mark.timeout(3600)
def test_two_clones_of_the_default_project_build_identical_wheels_for_every_variant(prefect_server, tmp_path):
    origin = _default_project(tmp_path / "origin")
    clones = _clones(origin, tmp_path)
    built = [_build(clone, tmp_path / f"out-{i}") for i, clone in enumerate(clones)]
    assert sorted(built[0]) == ["cpu", "cu130", "rocm"]
    # The cu130 wheel carries the nvcc-built torch extension (its sources' path once leaked into it).
    assert any(n.endswith("_aot/libkiln_csrc.so") for n in _members(built[0]["cu130"]))
    # Each wheel's SBOM (PEP 770) is part of the bytes compared below: it names no path and no clock.
    assert all(any(n.endswith(".dist-info/sboms/kiln.cdx.json") for n in _members(w)) for w in built[0].values())
    # Each native wheel is manylinux (issue 45): the torch extension by its glibc symbols, the hsaco alone by the
    # most compatible policy; the cpu wheel stays pure.
    assert _assert_manylinux(built[0]["cu130"], "cuda") != most_compatible()
    assert _assert_manylinux(built[0]["rocm"], "hip") == most_compatible()
    assert built[0]["cpu"].name.endswith("-py3-none-any.whl")
    _assert_identical(built[0], built[1], clones)


@pytest.mark.slow
@needs_nvcc
@pytest.mark.timeout(3600)
def test_two_clones_of_a_pep517_torch_extension_build_identical_wheels_for_every_variant(prefect_server, tmp_path):
    """ember: its own setup.py compiles a C++ op (cpu, Kiln's CPU torch) and a CUDA op (cu130, the shared CUDA
    torch environment, whose path lies inside each clone's build cache) with torch's cpp_extension."""
    envs = shared_cuda_torch_envs()
    origin = git_project("ember", tmp_path / "origin").parent
    clones = _clones(origin, tmp_path)
    for clone in clones:
        link_shared_envs(clone, envs)
    built = [_build(clone, tmp_path / f"out-{i}") for i, clone in enumerate(clones)]
    assert sorted(built[0]) == ["cpu", "cu130"]
    for variant, wheel in built[0].items():
        assert any(n.endswith(".so") for n in _members(wheel)), f"{wheel.name} compiled nothing"
        assert "-cp311-cp311-manylinux_2_" in wheel.name
        _assert_manylinux(wheel, "cuda" if variant == "cu130" else "cpu")
    assert git(clones[0], "rev-parse", "HEAD") == git(clones[1], "rev-parse", "HEAD")
    _assert_identical(built[0], built[1], clones)
