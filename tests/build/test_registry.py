"""load_registry: import the configured entry point, validate what it returns."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest

from kiln.core.errors import ConfigError
from kiln.runtime.spec import KernelSpec, Specialization, TritonEntry
from kiln.tasks.build.plan import plan_build
from kiln.tasks.build.stage import prepare_build
from kiln.tasks.project.config import load_config
from kiln.tasks.project.registry import load_registry, read_registry
from tests.helpers.projects import FIXTURES, copy_project

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
from kiln.runtime.spec import KernelSpec
def Spec(name, supported=None):
    return KernelSpec(name, __name__, supported or {})
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
    first = load_config(copy_project("tiny", tmp_path / "one"))
    second_path = copy_project("tiny", tmp_path / "two")
    registry = second_path.parent / "tinyk" / "registry.py"
    registry.write_text(registry.read_text().replace('name="scale"', 'name="scale2"'))
    assert [s.name for s in load_registry(first)] == ["add", "scale"]
    assert [s.name for s in load_registry(load_config(second_path))] == ["add", "scale2"]
    assert [s.name for s in load_registry(first)] == ["add", "scale"]


# --- every field validated at load, named in the error ---------------------------

_IMPORT = "from kiln.runtime.spec import KernelSpec, Specialization, TritonEntry"
_ADD = 'Specialization("fp32_b64", add_sig, {"BLOCK": 64})'
_SCALE = 'Specialization("fp32_b64", scale_sig, {"BLOCK": 64})'
_ADD_MODULE = 'module="tinyk.add",'
_SCALE_MODULE = 'module="tinyk.scale",'


def _with_csrc(csrc: str) -> list[tuple[str, str]]:
    return [(_IMPORT, _IMPORT + ", CudaSource"), (_ADD_MODULE, f"{_ADD_MODULE} csrc={csrc},")]


def _edited_tiny(tmp_path: Path, edits: list[tuple[str, str]]) -> Path:
    """The tiny fixture with its registry.py edited; each edit must apply."""
    path = copy_project("tiny", tmp_path)
    registry = path.parent / "tinyk" / "registry.py"
    text = registry.read_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    registry.write_text(text)
    return path


def _refused(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_registry(load_config(path))
    return str(info.value)


BAD_FIELDS = [
    ("kernel name names a path", [('name="add"', 'name="../add"')], "kernel #0: field 'name' must be a name"),
    ("module outside the package", [(_ADD_MODULE, 'module="tinyk.nope",')],
     "kernel 'add': field 'module' must name a module of package 'tinyk'"),
    ("archs as one string", [('supported={"cuda": ("8.0",)}', 'supported={"cuda": "8.0"}')],
     "kernel 'scale': field \"supported['cuda']\" must be a list or tuple of arch names, got '8.0'"),
    ("signature misses a parameter", [('"n": "i32", "BLOCK"', '"BLOCK"')],
     "kernel 'add', specialization 'fp32_b64': field 'signature' gives no type for parameters ['n'] of"
     " add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK)"),
    ("signature names a non-parameter", [('"n": "i32", "BLOCK"', '"n": "i32", "m": "i32", "BLOCK"')],
     "field 'signature' names ['m'], which are not parameters of add_kernel"),
    ("constexpr without a value", [(_ADD, 'Specialization("fp32_b64", add_sig, {})')],
     "specialization 'fp32_b64': field 'constexprs' has no value for the constexpr parameters ['BLOCK']"),
    ("constexpr value for a runtime parameter", [(_ADD, 'Specialization("fp32_b64", add_sig, {"BLOCK": 64, "n": 8})')],
     "field 'constexprs' gives values for ['n'], which the signature does not type 'constexpr'"),
    ("cpu backend", [(_ADD, _ADD[:-1] + ', backends=("cuda", "cpu"))')],
     "field 'backends' must list distinct backends from ('cuda', 'hip'), got ['cuda', 'cpu']"),
    ("bad min_arch", [(_ADD, _ADD[:-1] + ', min_arch={"cuda": "sm_89"})')],
     "specialization 'fp32_b64': field \"min_arch['cuda']\" has a bad arch: unknown CUDA arch 'sm_89'"),
    ("options not a mapping", [(_ADD, _ADD[:-1] + ', options=[("num_warps", 4)])')],
     "field 'options' must map triton.compile option names to values, got list"),
    ("aligned constexpr", [(_ADD, _ADD[:-1] + ', aligned=("x_ptr", "BLOCK"))')],
     "field 'aligned' names ['BLOCK'], which are not runtime parameters in the signature"),
    ("entry with no specializations", [(f"({_SCALE},)", "()")],
     "kernel 'scale', triton entry 'scale_kernel': field 'specializations' is empty"),
    ("duplicate specialization names", [(f"({_ADD},)", f"({_ADD}, {_ADD})")],
     "kernel 'add': field 'triton' has duplicate specialization names ['fp32_b64']"),
    ("bench_cases not callable", [(_SCALE_MODULE, f'{_SCALE_MODULE} bench_cases="small",')],
     "kernel 'scale': field 'bench_cases' must be a callable size -> cases, or None, got 'small'"),
    ("csrc source missing", _with_csrc('CudaSource("add_cu", ("csrc/missing.cu",), ("8.0",), "libadd.so")'),
     "kernel 'add', csrc 'add_cu': field 'sources[0]' names 'csrc/missing.cu', which is not a file under"),
    ("csrc source outside the package", _with_csrc('CudaSource("add_cu", ("../kiln.toml",), ("8.0",), "libadd.so")'),
     "field 'sources[0]' names '../kiln.toml'; sources are relative to the package directory, without '..'"),
    ("csrc library not a .so", _with_csrc('CudaSource("add_cu", ("add.py",), ("8.0",), "add.dll")'),
     "csrc 'add_cu': field 'library' must be a shared-library file name ending in '.so', got 'add.dll'"),
    ("csrc arch", _with_csrc('CudaSource("add_cu", ("add.py",), ("sm_80",), "libadd.so")'),
     "csrc 'add_cu': field 'supported' has a bad arch: unknown CUDA arch 'sm_80'"),
    ("two kernels, one library", _with_csrc('CudaSource("add_cu", ("add.py",), ("8.0",), "libx.so")')
     + [(_SCALE_MODULE, f'{_SCALE_MODULE} csrc=CudaSource("s_cu", ("scale.py",), ("8.0",), "libx.so"),')],
     "kernels ['add', 'scale'] all build 'libx.so'"),
]


@pytest.mark.parametrize(("label", "edits", "needle"), BAD_FIELDS, ids=[b[0] for b in BAD_FIELDS])
def test_bad_field_is_refused_naming_kernel_specialization_and_field(tmp_path, label, edits, needle):
    message = _refused(_edited_tiny(tmp_path, edits))
    assert message.startswith("project.registry = 'tinyk.registry:registry': "), message
    assert needle in message, f"{label}: {needle!r} not in {message}"


def test_wrong_type_is_refused_before_anything_compiles(tmp_path):
    path = _edited_tiny(tmp_path, [(_ADD, 'Specialization("fp32_b64", list(add_sig), {"BLOCK": 64})')])
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError) as info:
        prepare_build(str(path), "0.1.0", None, cache_dir=str(cache))
    assert str(info.value) == (
        "project.registry = 'tinyk.registry:registry': kernel 'add', specialization 'fp32_b64': field 'signature'"
        " must map parameter names to Triton type strings, got list")
    assert not cache.exists()


# tinyk's registry as duck-typed dataclasses, as a project that does not import
# kiln.runtime could write it. {spec_fields} / {kernel_fields}: extra fields.
_DUCK = '''
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Specialization:
    name: str
    signature: dict[str, str]
    constexprs: dict[str, Any] = field(default_factory=dict)
    min_arch: dict[str, str] = field(default_factory=dict)
{spec_fields}

@dataclass(frozen=True)
class TritonEntry:
    name: str
    fn: Any
    specializations: tuple[Specialization, ...]


@dataclass(frozen=True)
class KernelSpec:
    name: str
    module: str
    supported: dict[str, tuple[str, ...]]
    triton: tuple[TritonEntry, ...] = ()
    bench_cases: Any = None
    description: str = ""
{kernel_fields}

def registry() -> list[KernelSpec]:
    from tinyk.add import add_kernel
    from tinyk.scale import scale_kernel

    add_sig = {{"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}}
    scale_sig = {{"x_ptr": "*fp32", "out_ptr": "*fp32", "alpha": "fp32", "n": "i32", "BLOCK": "constexpr"}}
    return [
        KernelSpec("add", "tinyk.add", {{"cuda": ("8.0", "9.0"), "hip": ("gfx942",)}},
                   (TritonEntry("add_kernel", add_kernel, (Specialization("fp32_b64", add_sig, {{"BLOCK": 64}}),)),)),
        KernelSpec("scale", "tinyk.scale", {{"cuda": ("8.0",)}},
                   (TritonEntry("scale_kernel", scale_kernel, (Specialization("fp32_b64", scale_sig, {{"BLOCK": 64}}),)),)),
    ]
'''
_FULL_SPEC = ('    backends: tuple[str, ...] = ("cuda", "hip")\n    options: dict[str, Any] = field(default_factory=dict)\n'
              '    aligned: tuple[str, ...] = ()\n')
_FULL_KERNEL = "    csrc: Any = None\n"


def _duck_tiny(dest: Path, spec_fields: str, kernel_fields: str) -> Path:
    path = copy_project("tiny", dest)
    (path.parent / "tinyk" / "registry.py").write_text(_DUCK.format(spec_fields=spec_fields, kernel_fields=kernel_fields))
    return path


def test_duck_typed_registry_with_every_field_plans_like_the_spec_types(tmp_path):
    duck = load_config(_duck_tiny(tmp_path / "duck", _FULL_SPEC, _FULL_KERNEL))
    typed = load_config(copy_project("tiny", tmp_path / "typed"))
    plans = [plan_build(c, load_registry(c), {"triton": "3.9.0"}) for c in (duck, typed)]
    assert [(u.id, u.key) for u in plans[0].units] == [(u.id, u.key) for u in plans[1].units]
    assert len(plans[0].units) == 4


@pytest.mark.parametrize(("spec_fields", "kernel_fields", "needle"), [
    # Both passed the old check and then crashed the planner with a raw AttributeError.
    (_FULL_SPEC, "", "kernel 'add': field 'csrc' is missing: the object has no attribute 'csrc'"),
    (_FULL_SPEC.replace('    backends: tuple[str, ...] = ("cuda", "hip")\n', ""), _FULL_KERNEL,
     "kernel 'add', specialization 'fp32_b64': field 'backends' is missing: the object has no attribute 'backends'"),
], ids=["csrc", "backends"])
def test_duck_typed_registry_missing_a_field_is_refused_before_anything_compiles(tmp_path, spec_fields,
                                                                                  kernel_fields, needle):
    path = _duck_tiny(tmp_path, spec_fields, kernel_fields)
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError) as info:
        prepare_build(str(path), "0.1.0", None, cache_dir=str(cache))
    assert needle in str(info.value)
    assert "kiln.runtime.spec." in str(info.value)  # says which shape to follow
    assert not cache.exists()


def test_records_are_copies_frozen_against_the_projects_objects(tiny_config):
    signature = {"x": "*fp32", "BLOCK": "constexpr"}
    supported = {"cuda": ["8.0"]}
    special = Specialization("s", signature, {"BLOCK": 64}, min_arch={"cuda": "8.0"})
    fn = object()  # a stand-in: only a Triton function's arg_names are read, and this has none
    kernel = KernelSpec("k", "tinyk.add", supported, (TritonEntry("k_kernel", fn, (special,)),))
    (record,) = read_registry(tiny_config, [kernel])
    signature["y"] = "*fp32"
    supported["cuda"].append("9.0")
    assert dict(record.triton[0].specializations[0].signature) == {"x": "*fp32", "BLOCK": "constexpr"}
    assert record.supported == {"cuda": ("8.0",)}
    assert record.triton[0].fn is fn  # the Triton function travels as it is
    with pytest.raises(TypeError):
        record.triton[0].specializations[0].signature["z"] = "i32"  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.name = "other"  # type: ignore[misc]
