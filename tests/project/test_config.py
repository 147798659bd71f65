"""kiln.toml validation: every kind of mistake gets a message naming the key."""

from __future__ import annotations

import shutil
import threading
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from pydantic import ValidationError

from kiln.core.errors import ConfigError
from kiln.flows.cli import main
from kiln.tasks.project.config import load_config, parse_config

REPO = Path(__file__).resolve().parents[2]


def default_data() -> dict:
    return tomllib.loads((REPO / "kiln.toml").read_text())


def test_default_config_loads_into_typed_settings():
    config = load_config(REPO / "kiln.toml")
    assert [v.name for v in config.variants] == ["cu130", "rocm", "cpu"]
    assert config.variant("cu130").archs == ("8.0", "9.0", "10.0", "12.0")
    assert config.variant("rocm").backend == "hip"
    assert config.publish.targets[config.publish.default_target].kind == "file"
    assert set(config.permissions) == {"build", "test", "bench", "publish-nightly", "publish-release", "prune-nightly"}
    with pytest.raises(ValidationError, match="frozen"):
        config.project.version = "9"  # frozen: nothing deeper may mutate settings


def _mutate(path: str, value):
    """Set (or with value=KeyError, delete) a dotted key such as 'variants.0.archs'."""

    def apply(data: dict) -> dict:
        *parents, last = path.split(".")
        node = data
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        key = int(last) if last.isdigit() else last
        if value is KeyError:
            del node[key]
        else:
            node[key] = value
        return data

    return apply


BAD_CONFIGS = [
    ("top-level typo", _mutate("projekt", {}), ["unknown key 'projekt'", "did you mean 'project'"]),
    ("nested typo", _mutate("build.jbos", 4), ["unknown key 'build.jbos'", "did you mean 'jobs'"]),
    ("variant typo", _mutate("variants.0.arch", ["9.0"]), ["variants[0].arch", "did you mean 'archs'"]),
    ("unknown CUDA arch", _mutate("variants.0.archs", ["8.0", "9.9x"]), ["variants[0]", "unknown CUDA arch '9.9x'"]),
    ("native arch", _mutate("variants.0.archs", ["native"]), ["'native' is refused"]),
    ("bad ROCm arch", _mutate("variants.1.archs", ["mi300"]), ["unknown ROCm arch 'mi300'"]),
    ("archs on cpu", _mutate("variants.2.archs", ["9.0"]), ["backend 'cpu' takes no archs"]),
    ("unknown backend", _mutate("variants.0.backend", "metal"), ["variants[0].backend"]),
    ("duplicate variant", _mutate("variants.1.name", "cu130"), ["duplicate variant names: ['cu130']"]),
    ("bad version", _mutate("project.version", "one.two"), ["project.version", "not a PEP 440 version"]),
    ("local version", _mutate("project.version", "1.0+cu130"), ["project.version", "local part"]),
    ("missing key", _mutate("project.package", KeyError), ["missing key 'project.package'"]),
    ("bad registry", _mutate("project.registry", "kiln_kernels.registry"), ["project.registry", "module:attribute"]),
    ("bad target", _mutate("publish.targets.local.url", "ftp://x"), ["publish.targets.local.url", "one of file://, s3://"]),
    ("unknown default target", _mutate("publish.default_target", "gcs"), ["default_target 'gcs'"]),
    ("bad owner", _mutate("publish.targets.s3.expected_owner", "me"), ["publish.targets.s3.expected_owner"]),
    ("checksum setting on a file target", _mutate("publish.targets.local.verifies_checksums", True),
     ["publish.targets.local", "verifies_checksums applies to s3:// targets only"]),
    ("unknown step", _mutate("permissions.deploy", {}), ["permissions.deploy"]),
    ("two credential sources", _mutate("permissions.build.credentials", {"block": "b", "ambient": True}),
     ["permissions.build.credentials", "exactly one of"]),
    ("missing suite path", _mutate("suites.0.paths", ["tests/nope"]),
     ["suites[0].paths: 'tests/nope'", "do not exist"]),
    ("missing source", _mutate("project.source", "nope"), ["project.source = 'nope'"]),
    ("malformed requirement", _mutate("project.dependencies", ["torch>=>2.6"]),
     ["project.dependencies[0]: 'torch>=>2.6' is not a valid requirement: "]),
    ("second requirement malformed", _mutate("project.dependencies", ["numpy", "triton>=3.6; os_nam == 'x'"]),
     ["project.dependencies[1]: \"triton>=3.6; os_nam == 'x'\" is not a valid requirement"]),
    ("malformed specifier", _mutate("project.requires_python", ">=>3.10"),
     ["project.requires_python: '>=>3.10' is not a valid version specifier"]),
    ("bad distribution name", _mutate("project.distribution", "-kiln kernels"),
     ["project.distribution: '-kiln kernels' is not a valid distribution name"]),
    ("package not an import name", _mutate("project.package", "kiln-kernels"),
     ["project.package: 'kiln-kernels' is not an import name"]),
    ("registry not dotted names", _mutate("project.registry", "kiln kernels:registry"),
     ["project.registry", "dotted Python names"]),
    ("source outside the project", _mutate("project.source", "../elsewhere"),
     ["project.source: '../elsewhere' must be a path inside the project"]),
    ("absolute suite path", _mutate("suites.0.paths", ["/etc"]), ["suites[0].paths[0]: '/etc' must be a path inside"]),
    ("suite depends outside", _mutate("suites.0.depends", ["kernels/", "../x"]), ["suites[0].depends[1]"]),
    ("endpoint not http", _mutate("publish.targets.s3.endpoint", "ftp://127.0.0.1"),
     ["publish.targets.s3.endpoint", "http:// or https://"]),
    ("endpoint bad port", _mutate("publish.targets.s3.endpoint", "http://127.0.0.1:port"),
     ["publish.targets.s3.endpoint: 'http://127.0.0.1:port' is not a URL"]),
    ("bad bucket", _mutate("publish.targets.s3.url", "s3://Kiln_Wheels/simple"),
     ["publish.targets.s3.url", "'Kiln_Wheels' is not an S3 bucket name"]),
    ("s3 prefix traversal", _mutate("publish.targets.s3.url", "s3://kiln-wheels/a/../b"),
     ["publish.targets.s3.url", "not a plain key path"]),
    ("unknown placeholder", _mutate("publish.targets.local.url", "file://{outdir}/index"),
     ["publish.targets.local.url", "unknown placeholders ['{outdir}']"]),
    ("no registry, Kiln builds", _mutate("project.registry", KeyError), ["project.registry is missing", "pep517"]),
    ("unknown build backend", _mutate("build.backend", "cmake"), ["build.backend"]),
    ("pep517 without pyproject", lambda d: {**d, "build": {**d["build"], "backend": "pep517", "project_dir": "tests"}},
     ["build.project_dir = 'tests' has no pyproject.toml"]),
    ("flag choosing archs", _mutate("build.toolchain", {"nvcc_flags": ["-O3", "-gencode"]}),
     ["build.toolchain.nvcc_flags[1]", "chooses device archs"]),
    ("native in a flag", _mutate("build.toolchain", {"hipcc_flags": ["--offload-arch=native"]}),
     ["build.toolchain.hipcc_flags[0]"]),
    ("bad define", _mutate("build.toolchain", {"defines": ["1X=2"]}), ["build.toolchain.defines[0]", "macro"]),
    ("bad library", _mutate("build.toolchain", {"libraries": ["-lcudart"]}), ["build.toolchain.libraries[0]"]),
    ("missing include dir", _mutate("build.toolchain", {"include_dirs": ["csrc/nope"]}),
     ["build.toolchain.include_dirs: 'csrc/nope'"]),
    ("build cache typo", _mutate("build.cache", {"readonly": True}),
     ["unknown key 'build.cache.readonly'", "did you mean 'read_only'"]),
    ("unknown cache tier", _mutate("build.cache", {"remote": "artifact"}),
     ["build.cache.remote", "did you mean 'artifacts'"]),
    ("bad cache prefix", _mutate("build.cache", {"remote": "artifacts", "prefix": "../cache"}),
     ["build.cache.prefix"]),
    ("toolchain typo", _mutate("build.toolchain", {"nvcc_flag": ["-O3"]}),
     ["unknown key 'build.toolchain.nvcc_flag'", "did you mean 'nvcc_flags'"]),
    ("missing pins file", _mutate("publish.pins", "release/nope.json"), ["publish.pins = 'release/nope.json'"]),
    ("exclude leaves the package", _mutate("build.exclude", ["../x"]), ["build.exclude[0]"]),
    ("select_all outside", _mutate("testing", {"select_all": ["/etc/passwd"]}), ["testing.select_all[0]"]),
    ("bad region", _mutate("publish.targets.s3.region", "US East"), ["publish.targets.s3.region"]),
    ("extra index not a URL", _mutate("publish.extra_index_urls", ["ftp://mirror/simple"]),
     ["publish.extra_index_urls[0]", "must be an http(s):// or file:// index URL"]),
    ("bad history prefix", _mutate("bench.history", "../history"), ["bench.history", "plain relative path"]),
    ("empty channel prefix", _mutate("publish.channels.nightly", ""), ["publish.channels.nightly", "is empty"]),
    ("wildcard permission", _mutate("permissions.build.write", ["art*/"]),
     ["permissions.build.write[0]", "IAM wildcards"]),
    ("bad block name", _mutate("permissions.build.credentials", {"block": "Kiln Build"}),
     ["permissions.build.credentials.block"]),
    ("bad role arn", _mutate("permissions.build.credentials", {"role_arn": "publisher"}),
     ["permissions.build.credentials.role_arn"]),
    ("publisher without credentials", _mutate("permissions.publish-nightly.credentials", KeyError),
     ["permissions.publish-nightly: no credentials chosen", "s3://kiln-wheels/simple", "ambient = true"]),
]


@pytest.mark.parametrize("label, mutate, expected", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_names_the_key(label, mutate, expected):
    with pytest.raises(ConfigError) as info:
        parse_config(mutate(default_data()), REPO)
    for fragment in expected:
        assert fragment in str(info.value), f"{label}: {fragment!r} not in {info.value}"


def test_invalid_toml_is_a_config_error(tmp_path):
    bad = tmp_path / "kiln.toml"
    bad.write_text("[project\nname = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "kiln.toml")


BAD_EDITS = {
    "arch": ('archs = ["8.0", "9.0", "10.0", "12.0"]', 'archs = ["8.0", "sm_90"]', "unknown CUDA arch 'sm_90'"),
    "requirement": ('"torch>=2.6"', '"torch>=>2.6"',
                    "project.dependencies[0]: 'torch>=>2.6' is not a valid requirement"),
}


@pytest.mark.parametrize("edit", sorted(BAD_EDITS))
@pytest.mark.parametrize("command", [["build"], ["nightly"], ["test"], ["publish"]])
def test_bad_config_starts_nothing(tmp_path, capsys, command, edit):
    project = tmp_path / "project"
    shutil.copytree(REPO / "kernels", project / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    (project / "tests" / "kernels").mkdir(parents=True)
    old, new, message = BAD_EDITS[edit]
    text = (REPO / "kiln.toml").read_text()
    assert old in text
    (project / "kiln.toml").write_text(text.replace(old, new))
    out = tmp_path / "out"

    status = main([*command, "--config", str(project / "kiln.toml"), "--out", str(out)])

    assert status == 2
    assert message in capsys.readouterr().err
    assert not out.exists(), "a rejected config must not create the run directory"


def test_loading_the_same_file_again_returns_the_same_object():
    first = load_config(REPO / "kiln.toml")
    assert load_config(REPO / "kiln.toml") is first
    assert load_config(str(REPO / "kiln.toml")) is first  # same file, spelled as a string


def test_an_edited_file_is_read_again(tmp_path):
    path = tmp_path / "kiln.toml"
    shutil.copytree(REPO / "tests" / "fixtures" / "projects" / "tiny", tmp_path, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", ".kiln"))
    before = load_config(path)
    path.write_text(path.read_text().replace('version = "0.1.0"', 'version = "0.2.0"'))
    after = load_config(path)
    assert (before.project.version, after.project.version) == ("0.1.0", "0.2.0")
    assert load_config(path) is after


def test_same_content_at_another_path_is_its_own_config(tmp_path):
    for name in ("one", "two"):
        shutil.copytree(REPO / "tests" / "fixtures" / "projects" / "tiny", tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__", ".kiln"))
    one, two = load_config(tmp_path / "one" / "kiln.toml"), load_config(tmp_path / "two" / "kiln.toml")
    assert one is not two and (one.root, two.root) == (tmp_path / "one", tmp_path / "two")


def test_concurrent_first_loads_agree_on_one_object(tmp_path):
    shutil.copytree(REPO / "tests" / "fixtures" / "projects" / "tiny", tmp_path, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", ".kiln"))
    barrier = threading.Barrier(8)

    def load(_):
        barrier.wait(timeout=60)
        return load_config(tmp_path / "kiln.toml")

    with ThreadPoolExecutor(8) as pool:
        configs = list(pool.map(load, range(8)))
    assert len({id(c) for c in configs}) == 1


def test_a_refused_config_is_checked_again_on_the_next_load(tmp_path):
    shutil.copytree(REPO / "tests" / "fixtures" / "projects" / "tiny", tmp_path, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", ".kiln"))
    shutil.rmtree(tmp_path / "tests")
    with pytest.raises(ConfigError, match="suites\\[0\\].paths: 'tests'"):
        load_config(tmp_path / "kiln.toml")
    (tmp_path / "tests").mkdir()  # same bytes, fixed project: not answered from a cache of the failure
    assert load_config(tmp_path / "kiln.toml").suites[0].paths == ("tests",)


def test_command_line_choices_are_the_closed_sets():
    """argparse choices derive from the one Literal of each closed set."""
    from typing import get_args

    from kiln.flows.cli import build_parser
    from kiln.tasks.bench.results import MetricChoice
    from kiln.tasks.project.config import BenchSize, Channel
    from kiln.tasks.testing.jobs import Isolation

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    choices = {(name, a.dest): tuple(a.choices) for name, p in sub.items() for a in p._actions if a.choices}
    assert choices[("test", "isolate")] == get_args(Isolation)
    assert choices[("bench", "size")] == get_args(BenchSize)
    assert choices[("bench", "metric")] == get_args(MetricChoice)
    assert choices[("publish", "channel")] == get_args(Channel)


@pytest.mark.parametrize(("dependencies", "runtime", "ships"), [
    (["torch>=2.6", "kiln-runtime"], None, True),  # the wheels require it: the index must carry it
    (["torch>=2.6", "Kiln_Runtime>=0.1"], None, True),  # by its canonical name, with a specifier
    (["torch>=2.6"], None, False),
    (["torch>=2.6"], True, True),
    (["kiln-runtime"], False, False),
])
def test_the_kiln_runtime_wheel_is_published_when_the_wheels_require_it(dependencies, runtime, ships):
    data = default_data()
    data["project"]["dependencies"] = dependencies
    if runtime is not None:
        data["project"]["runtime"] = runtime
    assert parse_config(data, REPO).project.ships_runtime is ships


def test_a_config_knows_the_file_it_was_read_from_and_a_run_records_it(tmp_path):
    from kiln.core.store import LocalStore
    from kiln.tasks.run.runs import start_run

    shutil.copytree(REPO / "tests" / "fixtures" / "projects" / "tiny", tmp_path, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", ".kiln"))
    (tmp_path / "kiln.toml").rename(tmp_path / "ci.toml")
    config = load_config(tmp_path / "ci.toml")
    assert config.config_file == tmp_path.resolve() / "ci.toml" and config.root == tmp_path.resolve()
    run = start_run(config, LocalStore(tmp_path / "store"), run_id="r1", flow="build", out=tmp_path / "out",
                    version="0.1.0")
    assert run.header.config == "ci.toml"  # was "kiln.toml" whatever --config named


@pytest.mark.parametrize("key", ["root", "config_file"])
def test_kiln_sets_where_a_config_lives_never_the_file(key):
    data = tomllib.loads((REPO / "kiln.toml").read_text())
    with pytest.raises(ConfigError, match=f"'{key}' is not a key of kiln.toml"):
        parse_config({**data, key: "/elsewhere"}, REPO)


def test_a_renamed_suite_key_still_loads_with_a_warning_naming_the_new_one():
    """Last round renamed [[suites]] timeout_s to test_timeout_s: an existing kiln.toml keeps loading for a release."""
    old = default_data()
    old["suites"][0].pop("test_timeout_s", None)
    old["suites"][0]["timeout_s"] = 120
    with pytest.warns(FutureWarning, match="'timeout_s' is deprecated.*rename it to 'test_timeout_s'"):
        config = parse_config(old, REPO)
    assert config.suites[0].test_timeout_s == 120
    new = default_data()
    new["suites"][0]["test_timeout_s"] = 120
    assert parse_config(new, REPO).suites[0] == config.suites[0]  # both spellings give one suite


def test_the_old_and_the_new_spelling_together_are_refused():
    data = default_data()
    data["suites"][0]["timeout_s"] = 60
    with pytest.raises(ConfigError, match="both 'timeout_s' \\(deprecated\\) and 'test_timeout_s' are set"):
        parse_config(data, REPO)
