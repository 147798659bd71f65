"""kiln.toml validation: every kind of mistake gets a message naming the key."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import pytest

from flows.cli import main
from release.errors import ConfigError
from tasks.config import load_config, parse_config

REPO = Path(__file__).resolve().parents[2]


def default_data() -> dict:
    return tomllib.loads((REPO / "kiln.toml").read_text())


def test_default_config_loads_into_typed_settings():
    config = load_config(REPO / "kiln.toml")
    assert [v.name for v in config.variants] == ["cu130", "rocm", "cpu"]
    assert config.variant("cu130").archs == ("8.0", "9.0", "10.0", "12.0")
    assert config.variant("rocm").backend == "hip"
    assert config.publish.targets[config.publish.default_target].kind == "file"
    assert set(config.permissions) == {"build", "test", "bench", "publish-nightly", "publish-release"}
    with pytest.raises(Exception):
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
    ("bad registry", _mutate("project.registry", "kernels.registry"), ["project.registry", "module:attribute"]),
    ("bad target", _mutate("publish.targets.local.url", "ftp://x"), ["publish.targets.local.url", "file:// or s3://"]),
    ("unknown default target", _mutate("publish.default_target", "gcs"), ["default_target 'gcs'"]),
    ("bad owner", _mutate("publish.targets.s3.expected_owner", "me"), ["publish.targets.s3.expected_owner"]),
    ("unknown step", _mutate("permissions.deploy", {}), ["permissions.deploy"]),
    ("two credential sources", _mutate("permissions.build.credentials", {"block": "b", "ambient": True}),
     ["permissions.build.credentials", "exactly one of"]),
    ("missing suite path", _mutate("suites.0.paths", ["tests/nope"]), ["suites[0].paths: 'tests/nope'", "do not exist"]),
    ("missing source", _mutate("project.source", "nope"), ["project.source = 'nope'"]),
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


@pytest.mark.parametrize("command", [["build"], ["nightly"], ["test"], ["publish"]])
def test_bad_config_starts_nothing(tmp_path, capsys, command):
    project = tmp_path / "project"
    shutil.copytree(REPO / "kernels", project / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    (project / "tests" / "kernels").mkdir(parents=True)
    text = (REPO / "kiln.toml").read_text().replace('archs = ["8.0", "9.0", "10.0", "12.0"]', 'archs = ["8.0", "sm_90"]')
    (project / "kiln.toml").write_text(text)
    out = tmp_path / "out"

    status = main([*command, "--config", str(project / "kiln.toml"), "--out", str(out)])

    assert status == 2
    assert "unknown CUDA arch 'sm_90'" in capsys.readouterr().err
    assert not out.exists(), "a rejected config must not create the run directory"
