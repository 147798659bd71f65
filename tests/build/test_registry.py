"""load_registry: import the configured entry point, validate what it returns."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from release.errors import ConfigError
from tasks.config import load_config
from tasks.registry import load_registry
from tests.build.conftest import FIXTURES

_counter = itertools.count()

_TOML = """
[project]
package = "{pkg}"
distribution = "x"
version = "0.1.0"
source = "{pkg}"
registry = "{entry}"

[[variants]]
name = "cpu"
backend = "cpu"

[publish]
default_target = "local"
[publish.targets.local]
url = "file://out"
"""


def _project(tmp_path: Path, body: str, entry_attr: str = "registry") -> Path:
    # A fresh module name per test: the import system caches modules by name.
    pkg = f"regfixture{next(_counter)}_{tmp_path.name.replace('-', '_')}"
    (tmp_path / pkg).mkdir()
    (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / pkg / "reg.py").write_text(body)
    (tmp_path / "kiln.toml").write_text(_TOML.format(pkg=pkg, entry=f"{pkg}.reg:{entry_attr}"))
    return tmp_path / "kiln.toml"


_SPEC = """
from dataclasses import dataclass, field
@dataclass
class Spec:
    name: str
    module: str = "m"
    supported: dict = field(default_factory=dict)
    triton: tuple = ()
    csrc: object = None
"""


def test_loads_the_tiny_fixture_registry():
    specs = load_registry(load_config(FIXTURES / "tiny" / "kiln.toml"))
    assert [s.name for s in specs] == ["add", "scale"]
    assert specs[1].supported == {"cuda": ("8.0",)}


@pytest.mark.parametrize(
    ("body", "attr", "needle"),
    [
        ("x = 1\n", "registry", "has no attribute 'registry'"),
        ("registry = 3\n", "registry", "is not callable"),
        ("def registry():\n    raise RuntimeError('boom')\n", "registry", "raised RuntimeError: boom"),
        ("def registry():\n    return {'a': 1}\n", "registry", "must return a list"),
        ("def registry():\n    return [object()]\n", "registry", "has no attribute 'name'"),
        (_SPEC + "def registry():\n    return [Spec('a'), Spec('a')]\n", "registry", "duplicate kernel name 'a'"),
        (_SPEC + "def registry():\n    return [Spec('a', supported={'cuda': ('sm_90',)})]\n", "registry", "unknown CUDA arch 'sm_90'"),
        (_SPEC + "def registry():\n    return [Spec('a', supported={'metal': ()})]\n", "registry", "unknown backend 'metal'"),
    ],
)
def test_bad_registry_is_a_config_error_naming_the_entry_point(tmp_path, body, attr, needle):
    config = load_config(_project(tmp_path, body, attr))
    with pytest.raises(ConfigError, match="project.registry") as info:
        load_registry(config)
    assert needle in str(info.value)


def test_unimportable_module_is_a_config_error(tmp_path):
    path = _project(tmp_path, "import does_not_exist_anywhere\n")
    with pytest.raises(ConfigError, match="cannot import module"):
        load_registry(load_config(path))


def test_each_project_root_gets_its_own_copy_of_a_same_named_package(tmp_path):
    from tests.build.conftest import copy_project

    first = load_config(copy_project("tiny", tmp_path / "one"))
    second_path = copy_project("tiny", tmp_path / "two")
    registry = second_path.parent / "tinyk" / "registry.py"
    registry.write_text(registry.read_text().replace('name="scale"', 'name="scale2"'))
    assert [s.name for s in load_registry(first)] == ["add", "scale"]
    assert [s.name for s in load_registry(load_config(second_path))] == ["add", "scale2"]
    assert [s.name for s in load_registry(first)] == ["add", "scale"]
