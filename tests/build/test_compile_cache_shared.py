"""The compile cache's shared tier, with real ccache and gcc in Kiln's sandbox: two workers with empty local
caches and one store (a file:// folder through ccache's file: backend; S3 on a loopback moto server through
Kiln's storage helper bridge) — the second compiles nothing and its objects are the first's bytes; a damaged
shared entry is a miss and a correct compile; a store that does not answer is a warning and plain compiles."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from kiln.core.objects import Store
from kiln.core.s3 import S3Store, make_client
from kiln.core.sandbox import guest_command, guest_environ
from kiln.core.store import LocalStore
from kiln.tasks.build.ccache_bridge import Bridge
from kiln.tasks.build.compile_cache import CompileCache, CompileStats, open_compile_cache, read_stats_log
from kiln.tasks.build.compile_tier import COMPILE_PREFIX, shared_tier
from kiln.tasks.project.config_build import BuildCacheSettings
from tests.helpers.s3 import S3_ENV

SOURCES = {
    "scale.c": "int scale(int x) { return 3 * x; }\n",
    "shift.c": "int shift(int x) { return x + 7; }\n",
    "square.c": "#include \"sq.h\"\nint square(int x) { return SQ(x); }\n",
}
HEADERS = {"sq.h": "#define SQ(x) ((x) * (x))\n"}

needs_tools = pytest.mark.skipif(shutil.which("gcc") is None or open_compile_cache(Path("/nonexistent/x")) is None,
                                 reason="gcc or ccache is not installed")
pytestmark = needs_tools

SHARED = BuildCacheSettings(remote="artifacts")


def _clone(dest: Path) -> Path:
    dest.mkdir(parents=True)
    for name, text in {**SOURCES, **HEADERS}.items():
        (dest / name).write_text(text)
    return dest


def _compile(cache: CompileCache, sources: Path, work: Path) -> tuple[dict[str, bytes], CompileStats]:
    """Compile every source of ``sources`` as a build does: gcc behind ccache, sandboxed (no network), granted
    what the compile cache names; the objects and what ccache's statistics log says of them."""
    work.mkdir(parents=True, exist_ok=True)
    log = work / "stats.log"
    env = guest_environ(work / "home", cache.environ(sources, log))
    objects = {}
    for name in sorted(SOURCES):
        out = work / f"{name}.o"
        cmd = guest_command([*cache.prefix(), shutil.which("gcc") or "gcc", "-c", "-O2", name, "-o", str(out)],
                            read=[sources, *cache.read_paths(), "/usr"], write=[work, *cache.write_paths()],
                            network="none")
        done = subprocess.run(cmd, cwd=sources, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        objects[name] = out.read_bytes()
    return objects, read_stats_log(log)


def _worker(root: Path, store: Store, settings: BuildCacheSettings = SHARED) -> CompileCache:
    """A worker's compile cache: its own empty local directory over the shared tier of ``store``."""
    cache = open_compile_cache(root / "cache", shared_tier(settings, store))
    assert cache is not None
    return cache


def _two_workers(tmp_path: Path, store: Store) -> None:
    first = _worker(tmp_path / "w1", store)
    cold, stats = _compile(first, _clone(tmp_path / "w1" / "src"), tmp_path / "w1" / "out")
    assert sorted(stats.compiled) == sorted(SOURCES) and stats.reused == ()

    # another worker, another clone path, an empty local cache: every translation unit comes from the store
    second = _worker(tmp_path / "w2", store)
    warm, stats = _compile(second, _clone(tmp_path / "w2" / "a-longer-clone-path"), tmp_path / "w2" / "out")
    assert stats.compiled == ()
    assert sorted(stats.reused) == sorted(stats.shared) == sorted(SOURCES)
    assert warm == cold

    # a one-file change on a third fresh worker compiles that file alone
    third = _worker(tmp_path / "w3", store)
    clone = _clone(tmp_path / "w3" / "src")
    (clone / "shift.c").write_text(SOURCES["shift.c"].replace("7", "8"))
    _, stats = _compile(third, clone, tmp_path / "w3" / "out")
    assert stats.compiled == ("shift.c",) and sorted(stats.reused) == ["scale.c", "square.c"]


def test_a_second_worker_compiles_nothing_through_a_file_store(tmp_path):
    store = LocalStore(tmp_path / "store")
    _two_workers(tmp_path, store)
    assert any((tmp_path / "store" / SHARED.prefix / COMPILE_PREFIX).rglob("*")), "the entries are in the store"


@pytest.mark.parametrize("reshare", [True, False])
def test_reshare_puts_a_workers_earlier_local_entries_in_the_tier_and_without_it_they_stay_local(tmp_path, reshare):
    """A worker whose local cache was filled before the shared tier existed: with ``reshare`` its local hits are
    written to the tier, so a fresh worker compiles nothing; without it the tier stays empty of them."""
    store = LocalStore(tmp_path / "store")
    local_only = open_compile_cache(tmp_path / "w1" / "cache")
    assert local_only is not None
    _, stats = _compile(local_only, _clone(tmp_path / "w1" / "src"), tmp_path / "w1" / "out-before")
    assert sorted(stats.compiled) == sorted(SOURCES)
    settings = BuildCacheSettings(remote="artifacts", reshare=reshare)
    first = _worker(tmp_path / "w1", store, settings)  # the same local directory, now over the shared tier
    _, stats = _compile(first, _clone(tmp_path / "w1" / "src2"), tmp_path / "w1" / "out")
    assert stats.compiled == () and stats.shared == ()  # local hits
    _, stats = _compile(_worker(tmp_path / "w2", store, settings), _clone(tmp_path / "w2" / "src"),
                        tmp_path / "w2" / "out")
    if reshare:
        assert stats.compiled == () and sorted(stats.shared) == sorted(SOURCES)
    else:
        assert sorted(stats.compiled) == sorted(SOURCES)


@pytest.mark.parametrize(("fields", "needle"), [
    ({"remote": "artifacts", "read_only": True}, "read_only = true never writes it"),
    ({"remote": "none"}, 'remote = "none" has none'),
])
def test_reshare_on_a_tier_it_cannot_write_is_refused_naming_why(fields, needle):
    with pytest.raises(ValueError, match=needle):
        BuildCacheSettings(reshare=True, **fields)


def test_a_corrupted_shared_entry_is_a_miss_and_a_correct_compile(tmp_path):
    store = LocalStore(tmp_path / "store")
    cold, _ = _compile(_worker(tmp_path / "w1", store), _clone(tmp_path / "w1" / "src"), tmp_path / "w1" / "out")
    entries = [p for p in (tmp_path / "store" / SHARED.prefix / COMPILE_PREFIX).rglob("*")
               if p.is_file() and p.name != "CACHEDIR.TAG"]
    assert entries
    for entry in entries:  # one byte of every result and manifest flipped, in the middle of its content
        data = bytearray(entry.read_bytes())
        data[len(data) // 2] ^= 0xFF
        entry.chmod(0o644)
        entry.write_bytes(bytes(data))
    objects, stats = _compile(_worker(tmp_path / "w2", store), _clone(tmp_path / "w2" / "src"),
                              tmp_path / "w2" / "out")
    assert sorted(stats.compiled) == sorted(SOURCES) and stats.shared == ()
    assert objects == cold


def test_a_read_only_tier_is_read_and_never_written(tmp_path):
    store = LocalStore(tmp_path / "store")
    reader = BuildCacheSettings(remote="artifacts", read_only=True)
    folder = tmp_path / "store" / SHARED.prefix / COMPILE_PREFIX
    assert shared_tier(reader, store) is None  # nothing shared yet: the folder is not made by a reader
    cold, _ = _compile(_worker(tmp_path / "w1", store), _clone(tmp_path / "w1" / "src"), tmp_path / "w1" / "out")
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    cache = _worker(tmp_path / "w2", store, reader)
    assert cache.shared is not None and folder not in cache.write_paths() and folder in cache.read_paths()
    clone = _clone(tmp_path / "w2" / "src")
    (clone / "scale.c").write_text(SOURCES["scale.c"].replace("3", "5"))
    objects, stats = _compile(cache, clone, tmp_path / "w2" / "out")
    assert stats.compiled == ("scale.c",) and sorted(stats.shared) == ["shift.c", "square.c"]
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before


def test_a_shared_folder_this_worker_cannot_use_is_a_warning_and_plain_compiles(tmp_path, caplog):
    store = LocalStore(tmp_path / "store")
    folder = tmp_path / "store" / SHARED.prefix / COMPILE_PREFIX
    folder.parent.mkdir(parents=True)
    folder.write_text("not a folder")  # what a mount gone wrong looks like to this worker (root ignores modes)
    with caplog.at_level(logging.WARNING, "kiln.tasks.build.compile_tier"):
        cache = _worker(tmp_path / "w1", store)
    assert cache.shared is None
    assert [r for r in caplog.records if "local cache only" in r.getMessage()]
    _, stats = _compile(cache, _clone(tmp_path / "w1" / "src"), tmp_path / "w1" / "out")
    assert sorted(stats.compiled) == sorted(SOURCES)


# --- S3, through Kiln's storage helper bridge --------------------------------------------------------------------

@pytest.fixture
def s3_store(s3_endpoint: str) -> S3Store:
    import boto3

    session = boto3.Session(aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
    client = make_client(session, "us-east-1", s3_endpoint)
    bucket = f"kiln-ccache-{id(session)}"
    client.create_bucket(Bucket=bucket)
    return S3Store(client, bucket, "artifacts")


def test_a_second_worker_compiles_nothing_through_an_s3_store(tmp_path, s3_store):
    _two_workers(tmp_path, s3_store)
    assert s3_store.list(f"{SHARED.prefix}/{COMPILE_PREFIX}/"), "the entries are in the bucket"


def test_the_bridge_writes_create_only_and_removes_nothing(tmp_path):
    bridge = Bridge(LocalStore(tmp_path / "store"), "build-cache/compile")
    assert bridge.put(b"\x01\x02", b"first") and bridge.get(b"\x01\x02") == b"first"
    assert not bridge.put(b"\x01\x02", b"other bytes")  # the first writer's bytes stay
    assert bridge.get(b"\x01\x02") == b"first" and bridge.stats.kept == 1
    assert bridge.get(b"\x09") is None and bridge.stats.misses == 1


def test_the_bridge_ends_with_the_build_that_holds_its_tier(tmp_path):
    tier = shared_tier(SHARED, _silent_store())
    assert tier is not None and tier.url.startswith("crsh:")
    socket_path = Path(tier.url.removeprefix("crsh:"))
    assert socket_path.exists()
    del tier  # the build dropped its compile cache
    assert not socket_path.exists()


def _silent_store() -> S3Store:
    """An S3 store whose endpoint refuses every connection (a port bound, never listened on)."""
    import boto3
    from botocore.config import Config

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1")
    client = session.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                            config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=2))
    store = S3Store(client, "absent", "artifacts")
    store._kiln_port_holder = holder  # type: ignore[attr-defined]  # the port stays refused while the store lives
    return store


def test_a_store_that_does_not_answer_is_one_warning_and_plain_compiles(tmp_path, caplog):
    store = _silent_store()
    with caplog.at_level(logging.WARNING, "kiln.tasks.build.ccache_bridge"):
        cache = _worker(tmp_path / "w1", store)
        _, stats = _compile(cache, _clone(tmp_path / "w1" / "src"), tmp_path / "w1" / "out")
    assert sorted(stats.compiled) == sorted(SOURCES) and stats.shared == ()
    warnings = [r for r in caplog.records if "did not answer" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_a_second_worker_builds_kilns_nvcc_library_with_no_compile_and_the_same_bytes(tmp_path):
    from kiln.tasks.build.nvcc import build_library_counted, find_nvcc
    from tests.build.test_compile_cache import ARCHS, FIXTURE, LABELS
    from tests.build.test_compile_cache import SOURCES as CU_SOURCES

    store = LocalStore(tmp_path / "store")
    built = []
    for worker in ("w1", "w2"):
        shutil.copytree(FIXTURE, tmp_path / worker / "csrc")
        sources = [tmp_path / worker / "csrc" / name for name in CU_SOURCES]
        built.append(build_library_counted(find_nvcc(), sources, "libmulticu.so", ARCHS, timeout=600,
                                           cache=_worker(tmp_path / worker, store)))
    (cold, first), (warm, second) = built
    assert sorted(first.compiled) == sorted(LABELS)
    assert second.compiled == () and sorted(second.shared) == sorted(LABELS)
    assert warm == cold


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_a_second_workers_build_of_a_changed_file_compiles_that_file_alone(prefect_server, tmp_path):
    """The build flow on two clones, each with its own local caches, and one file:// artifact store: the second
    worker, after a one-line change to one .cu, compiles that file and takes the other three from the store."""
    from kiln.core.manifest import RunManifest
    from kiln.flows.build import build_flow
    from tests.helpers.projects import copy_project

    store = tmp_path / "team-store"
    messages = []
    for worker, change in (("a", False), ("b", True)):
        config = copy_project("multicu", tmp_path / worker)
        config.write_text(config.read_text() + f'\n[build.cache]\nremote = "artifacts"\n\n'
                                               f'[artifacts]\nurl = "{store.as_uri()}"\n')
        if change:
            shift = config.parent / "multicu" / "csrc" / "shift.cu"
            shift.write_text(shift.read_text().replace("x[i] += b", "x[i] += 2.0f * b"))
        state = build_flow(str(config), str(tmp_path / worker / "out"), version="0.1.0.dev20261207",
                           return_state=True)
        run = RunManifest.load(tmp_path / worker / "out" / str(state.state_details.flow_run_id))
        assert state.is_completed()
        messages.append(next(u for u in run.units if u.id == "build/cu130/sm_90/multicu/multicu").message)
    assert "4 of 4 compilations (translation unit × arch) compiled, 0 reused" in messages[0]
    assert "1 of 4 compilations (translation unit × arch) compiled, 3 reused (3 from the shared tier)" in messages[1]


@pytest.mark.slow
def test_a_second_worker_builds_a_setuptools_wheel_with_no_compile_and_the_same_bytes(tmp_path):
    """A package's own build (pep517, sandboxed): the second worker's compilers are served by the shared tier."""
    from kiln.tasks.build.stage import compile_context, prepare_build
    from kiln.tasks.build.units import build_unit
    from tests.helpers.projects import FIXTURES

    store = LocalStore(tmp_path / "team-store")
    results = []
    for worker in ("w1", "worker-two-with-a-longer-path"):
        project = tmp_path / worker / "cmulti"
        shutil.copytree(FIXTURES / "cmulti", project, ignore=shutil.ignore_patterns("__pycache__", ".kiln"))
        config = project / "kiln.toml"
        config.write_text(config.read_text() + '\n[build.cache]\nremote = "artifacts"\n')
        setup = prepare_build(str(config), "1.0.0", None, cache_dir=str(tmp_path / worker / "cache"), store=store)
        (unit,) = setup.plan.units
        with compile_context(setup, tmp_path / worker / "out") as context:
            result = build_unit(unit, context)
        (wheel,) = [f for f in result.files if f.name.endswith(".whl")]
        results.append((result.compile, wheel.read_bytes()))
        # the whole unit is in the unit cache's tier too; without it (another key: a Python change elsewhere in a
        # real project) the unit runs, and its compilers find their objects in the compile cache's tier
        shutil.rmtree(tmp_path / "team-store" / SHARED.prefix / "entries")
    (cold, cold_wheel), (warm, warm_wheel) = results
    sources = ["csrc/add.c", "csrc/module.c", "csrc/mul.c"]
    assert cold is not None and sorted(cold.compiled) == sources
    assert warm == CompileStats((), tuple(sources), tuple(sources)), warm
    assert warm_wheel == cold_wheel


def _pep517_build(project: Path, cache_root: Path, store: Store, out: Path) -> tuple[object, list[Path]]:
    """The cmulti fixture's variant built and assembled the way the build stage does; its setup and wheels."""
    from kiln.tasks.build.stage import assemble_variant, compile_context, prepare_build
    from kiln.tasks.build.units import build_unit

    setup = prepare_build(str(project / "kiln.toml"), "1.0.0", None, cache_dir=str(cache_root), store=store)
    with compile_context(setup, out) as context:
        outcomes = {unit.id: build_unit(unit, context) for unit in setup.plan.units}
    wheels = []
    for variant in setup.plan.variants:
        output = assemble_variant(setup, variant, {u.id: outcomes[u.id] for u in variant.units}, out)
        wheels += [path for path, kind in output.files if kind == "wheel"]
    return setup, wheels


def _results(folder: Path) -> list[Path]:
    """The result entries (not manifests) of a ccache file: storage, as ccache itself tells them apart."""
    launcher = open_compile_cache(folder.parent / "inspect")
    assert launcher is not None
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "CACHEDIR.TAG" and "Entry type: 0 (result)"
                  in subprocess.run([launcher.launcher, "--inspect", str(p)], capture_output=True, text=True,
                                    timeout=60, check=True).stdout)


@pytest.mark.slow
def test_a_planted_shared_compile_entry_is_served_and_the_witness_refuses_the_wheel_naming_the_member(tmp_path):
    """Well-formed entries under other keys (each result moved to the next one's key: valid checksums, objects
    of other translation units) pass ccache's own checks; the witness, whose compiles read no cache, differs."""
    from kiln.tasks.build.witness import witness
    from tests.helpers.projects import FIXTURES

    store = LocalStore(tmp_path / "team-store")
    projects = []
    for worker in ("w1", "w2"):
        project = tmp_path / worker / "cmulti"
        shutil.copytree(FIXTURES / "cmulti", project, ignore=shutil.ignore_patterns("__pycache__", ".kiln"))
        (project / "kiln.toml").write_text((project / "kiln.toml").read_text() + '\n[build.cache]\nremote = "artifacts"\n')
        projects.append(project)
    _pep517_build(projects[0], tmp_path / "w1" / "cache", store, tmp_path / "w1" / "out")
    shutil.rmtree(tmp_path / "team-store" / SHARED.prefix / "entries")  # the unit tier would serve the whole wheel
    results = _results(tmp_path / "team-store" / SHARED.prefix / COMPILE_PREFIX)
    assert len(results) == 3
    planted = [p.read_bytes() for p in results]
    for path, data in zip(results, planted[1:] + planted[:1], strict=True):
        path.chmod(0o644)
        path.write_bytes(data)

    setup, wheels = _pep517_build(projects[1], tmp_path / "w2" / "cache", store, tmp_path / "w2" / "out")
    found = witness(setup, wheels)  # type: ignore[arg-type]
    assert not found.ok and len(found.differing) == 1
    (members,) = found.differing.values()
    assert any(member.endswith(".so") for member in members), members
    assert "the witness refuses" in found.message()


def test_a_bridge_that_is_gone_is_counted_and_warned_and_the_compiles_run(tmp_path, caplog):
    from kiln.tasks.build.compile_cache import SharedTier, warn_shared_faults

    bridge = Bridge(LocalStore(tmp_path / "store"), "build-cache/compile").start()
    tier = SharedTier(f"crsh:{bridge.socket_path}", False, bridge.socket_path.parent)
    bridge.close()  # the build step's helper stopped (idle, or its process ended) while compiles still ran
    cache = open_compile_cache(tmp_path / "cache", tier)
    assert cache is not None
    _, stats = _compile(cache, _clone(tmp_path / "src"), tmp_path / "out")
    assert sorted(stats.compiled) == sorted(SOURCES) and stats.shared_faults == len(SOURCES)
    with caplog.at_level(logging.WARNING, "kiln.tasks.build.compile_cache"):
        warn_shared_faults(stats, "libx.so")
    assert [r for r in caplog.records if "3 compile(s) of libx.so" in r.getMessage()]
