"""Every native wheel's ABI claims are audited by the ecosystem's tools (issue 45, part 2).

Real parts: CPython C-API extensions compiled here with gcc (one inside the limited API, one calling
``PyObject_CallOneArg``, which is not in it, one calling 3.13's ``PyList_GetItemRef``); two libraries compiled
with g++ against the installed torch's headers and libraries (one calling ``c10::DeviceTypeName``, unstable, one
calling the stable C shim ``aoti_torch_get_numel``); wheels written by Kiln's own writers (``build_wheel``,
``rewrite_wheel``); ``abi3audit`` and ``torch-abi-audit`` run as their command lines; ``kiln audit-abi`` called
as the console script's ``main``.
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from kiln.core.errors import AbiAuditError, ConfigError
from kiln.flows.cli import main
from kiln.tasks.build.cache import BuildCache
from kiln.tasks.build.stage import assemble_variant, prepare_build
from kiln.tasks.project.config import KilnConfig, load_config
from kiln.tasks.wheel import abi_audit
from kiln.tasks.wheel.abi_audit import abi3_claim, audit_members, audit_wheel
from kiln.tasks.wheel.assemble import WheelInput, WheelStamp, build_wheel, write_wheel
from kiln.tasks.wheel.manylinux import linux_platform
from kiln.tasks.wheel.rewheel import rewrite_wheel
from tests.helpers.projects import copy_project

STAMP = WheelStamp.for_commit("c" * 40, 1764450423, {"torch": "2.13.0"}, environ={})
_MODULE = """#define Py_LIMITED_API 0x030B0000
#include <Python.h>
{declare}
static PyObject *call(PyObject *self, PyObject *arg) {{ {body} }}
static PyMethodDef methods[] = {{{{"call", call, METH_O, NULL}}, {{NULL, NULL, 0, NULL}}}};
static struct PyModuleDef module = {{PyModuleDef_HEAD_INIT, "_C", NULL, -1, methods}};
PyMODINIT_FUNC PyInit__C(void) {{ return PyModule_Create(&module); }}
"""
_EXTENSIONS = {
    "clean": ("", "return PyObject_CallFunctionObjArgs(arg, arg, NULL);"),
    # not in the limited API: the header leaves it out under Py_LIMITED_API, so it is declared by hand
    "planted": ("PyObject *PyObject_CallOneArg(PyObject *, PyObject *);", "return PyObject_CallOneArg(arg, arg);"),
    # in the limited API since 3.13 only
    "newer": ("PyObject *PyList_GetItemRef(PyObject *, Py_ssize_t);", "return PyList_GetItemRef(arg, 0);"),
}
_UNSTABLE = ('#include <c10/core/DeviceType.h>\n'
             'extern "C" int kiln_op(void) { return (int)c10::DeviceTypeName(c10::DeviceType::CPU, false).size(); }\n')
_STABLE = ('#include <torch/csrc/inductor/aoti_torch/c/shim.h>\n'
           'extern "C" int64_t kiln_numel(AtenTensorHandle t) { int64_t n = 0; aoti_torch_get_numel(t, &n);'
           ' return n; }\n')


def _compile(compiler: str, source: str, out: Path, *flags: str) -> Path:
    src = out.with_suffix(".cpp" if compiler == "g++" else ".c")
    src.write_text(source)
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(out), str(src), *flags], check=True, timeout=300,
                   capture_output=True)
    return out


@pytest.fixture(scope="module")
def extensions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """CPython extensions (no torch): ``clean``, ``planted`` (PyObject_CallOneArg) and ``newer`` (3.13 API)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    root = tmp_path_factory.mktemp("cext")
    include = f"-I{sysconfig.get_paths()['include']}"
    return {name: _compile("gcc", _MODULE.format(declare=declare, body=body), root / f"{name}.so", include)
            for name, (declare, body) in _EXTENSIONS.items()}


@pytest.fixture(scope="module")
def torch_libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Libraries built against the installed torch: ``unstable`` (c10::) and ``stable`` (the aoti_torch C shim)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    from torch.utils.cpp_extension import include_paths, library_paths

    root = tmp_path_factory.mktemp("torchlibs")
    flags = ["-std=c++17", *(f"-I{p}" for p in include_paths()), *(f"-L{p}" for p in library_paths())]
    return {"unstable": _compile("g++", _UNSTABLE, root / "libunstable.so", *flags, "-lc10"),
            "stable": _compile("g++", _STABLE, root / "libstable.so", *flags, "-ltorch_cpu", "-lc10")}


def _backend_wheel(out: Path, extension: Path, tag: str = "cp311-abi3") -> Path:
    """ember's wheel as a PEP 517 backend writes it with ``py_limited_api``: ``ember/_C.abi3.so``."""
    plat = linux_platform()
    members = {"ember/_C.abi3.so": extension.read_bytes(), "ember/__init__.py": b"",
               "ember_ops-0.2.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: ember-ops\nVersion: 0.2.0\n",
               "ember_ops-0.2.0.dist-info/WHEEL": f"Wheel-Version: 1.0\nGenerator: setuptools (80.9.0)\n"
                                                  f"Root-Is-Purelib: false\nTag: {tag}-{plat}\n\n".encode()}
    return write_wheel(out, f"ember_ops-0.2.0-{tag}-{plat}.whl", sorted(members.items()), STAMP)


def _tiny_path(tmp_path: Path, abi: str | None = None, variant: str = "cu130") -> Path:
    path = copy_project("tiny", tmp_path)
    if abi is not None:
        path.write_text(path.read_text().replace(f'name = "{variant}"\n', f'name = "{variant}"\nabi = "{abi}"\n', 1))
    return path


def _tiny(tmp_path: Path, abi: str | None = None) -> KilnConfig:
    return load_config(_tiny_path(tmp_path, abi))


def _torch_wheel(tmp_path: Path, config: KilnConfig, *libraries: Path) -> Path:
    return build_wheel(config, "0.1.0.dev20261129+cu130", [WheelInput(lib, f"cuda/{lib.name}") for lib in libraries],
                       [], tmp_path / "out", variant=config.variant("cu130"), stamp=STAMP)


def test_an_abi3_wheel_with_a_symbol_outside_the_limited_api_fails_naming_it_and_writes_nothing(tmp_path,
                                                                                                 extensions):
    config = load_config(copy_project("ember", tmp_path))
    built = _backend_wheel(tmp_path / "built", extensions["planted"])
    with pytest.raises(AbiAuditError, match=r"ember/_C\.abi3\.so is tagged abi3 \(cp311-abi3\) but uses symbols"
                                            r" outside the limited API: PyObject_CallOneArg"):
        rewrite_wheel(config, config.variant("cpu"), "0.2.0.dev1+cpu", built, [], [], tmp_path / "out", STAMP)
    assert not list((tmp_path / "out").glob("*.whl"))


def test_a_clean_abi3_wheel_is_written_and_its_audit_says_compliant(tmp_path, extensions):
    config = load_config(copy_project("ember", tmp_path))
    built = _backend_wheel(tmp_path / "built", extensions["clean"])
    wheel = rewrite_wheel(config, config.variant("cpu"), "0.2.0.dev1+cpu", built, [], [], tmp_path / "out", STAMP)
    assert "-cp311-abi3-" in wheel.name
    audit = audit_wheel(wheel)
    assert audit.abi3 == "3.11" and audit.findings() == []
    assert audit.lines()[1] == "  ember/_C.abi3.so: torch no-torch; abi3 compliant"


def test_an_abi3_wheel_using_a_newer_limited_api_than_its_tag_is_refused(tmp_path, extensions):
    audit = audit_wheel(_backend_wheel(tmp_path, extensions["newer"]))
    assert audit.findings() == ["ember/_C.abi3.so uses the Python 3.13 limited API but is tagged for 3.11"]
    assert audit_wheel(_backend_wheel(tmp_path / "313", extensions["newer"], "cp313-abi3")).findings() == []


def test_a_wheel_not_tagged_abi3_is_not_held_to_the_limited_api(tmp_path, extensions):
    audit = audit_wheel(_backend_wheel(tmp_path, extensions["planted"], "cp311-cp311"))
    assert audit.abi3 is None and audit.findings() == []


def test_a_stable_variant_using_unstable_torch_symbols_fails_naming_them(tmp_path, torch_libs):
    with pytest.raises(AbiAuditError, match=r"cuda/libunstable\.so claims the torch stable ABI \(abi = \"stable\"\)"
                                            r" but uses unstable torch symbols: c10::DeviceTypeName"):
        _torch_wheel(tmp_path, _tiny(tmp_path, "stable"), torch_libs["unstable"], torch_libs["stable"])
    assert not list((tmp_path / "out").glob("*.whl"))


def test_a_stable_variant_on_the_stable_shims_passes_with_its_minimum_torch(tmp_path, torch_libs):
    wheel = _torch_wheel(tmp_path, _tiny(tmp_path, "stable"), torch_libs["stable"])
    audit = audit_wheel(wheel, torch_stable=True)
    assert audit.findings() == [] and audit.min_torch == "2.9.0"
    assert audit.lines()[1] == "  tinyk/_aot/cuda/libstable.so: torch stable; minimum torch 2.9.0"


def test_the_build_fails_the_variants_wheel_unit_naming_the_symbols(tmp_path, torch_libs):
    """The path the build takes: a package vendoring a library that uses c10:: in a variant claiming the stable
    ABI gets a failed wheel unit whose message names the symbol, and no wheel artifact."""
    config_path = _tiny_path(tmp_path, "stable", "cpu")
    shutil.copy(torch_libs["unstable"], config_path.parent / "tinyk" / "libunstable.so")
    setup = prepare_build(str(config_path), "0.1.0.dev20261129", ["cpu"], cache_dir=str(tmp_path / "cache"))
    (variant,) = setup.plan.variants
    output = assemble_variant(setup, variant, {}, tmp_path / "out")
    assert output.unit.state == "failed" and output.files == ()
    assert "tinyk/libunstable.so claims the torch stable ABI" in output.unit.message
    assert "c10::DeviceTypeName" in output.unit.message


def test_an_exact_variant_reports_its_unstable_symbols_without_failing(tmp_path, torch_libs):
    wheel = _torch_wheel(tmp_path, _tiny(tmp_path), torch_libs["unstable"])
    (library,) = audit_wheel(wheel).libraries
    assert library.torch == "unstable" and library.unstable_symbols[0].startswith("c10::DeviceTypeName")
    assert audit_wheel(wheel).findings() == []


def test_a_variant_abi_outside_the_closed_set_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"abi.*'exact' or 'stable'"):
        _tiny(tmp_path, "unstable")


def test_the_audit_is_kept_by_the_libraries_hashes_and_a_warm_audit_runs_no_tool(tmp_path, monkeypatch,
                                                                                   extensions):
    cache = BuildCache(tmp_path / "cache")
    members = [("ember/_C.abi3.so", extensions["planted"].read_bytes())]
    cold = audit_members("w.whl", f"cp311-abi3-{linux_platform()}", members, torch_stable=False, cache=cache)

    def no_tool(*args: object, **kwargs: object) -> None:  # fault injection: any tool run would fail the test
        raise AssertionError(f"a tool ran on a warm audit: {args}")

    monkeypatch.setattr(abi_audit, "run_in_group", no_tool)
    warm = audit_members("w.whl", f"cp311-abi3-{linux_platform()}", members, torch_stable=False, cache=cache)
    assert warm == cold and warm.libraries[0].non_abi3_symbols == ("PyObject_CallOneArg",)


@pytest.mark.parametrize(("tag", "expected"), [("cp311-abi3-linux_x86_64", "3.11"),
                                               ("cp310.cp312-abi3-linux_x86_64", "3.12"),
                                               ("cp311-cp311-linux_x86_64", None), ("py3-none-any", None)])
def test_the_abi3_claim_is_the_python_its_tag_names(tag, expected):
    assert abi3_claim(tag) == expected


def test_kiln_audit_abi_exits_0_clean_1_on_a_broken_claim_2_on_bad_input(tmp_path, capsys, extensions):
    clean = _backend_wheel(tmp_path / "clean", extensions["clean"])
    planted = _backend_wheel(tmp_path / "planted", extensions["planted"])
    assert main(["audit-abi", str(clean)]) == 0
    assert main(["audit-abi", str(clean), str(planted)]) == 1
    assert "uses symbols outside the limited API: PyObject_CallOneArg" in capsys.readouterr().out
    not_a_wheel = tmp_path / "ember_ops-0.2.0-py3-none-any.whl"
    not_a_wheel.write_bytes(b"not a zip")
    assert main(["audit-abi", str(not_a_wheel)]) == 2
    assert main(["audit-abi", str(tmp_path / "notes.txt")]) == 2
    assert "notes.txt: not a readable wheel" in capsys.readouterr().err


def test_a_wheel_without_a_shared_library_has_nothing_to_audit():
    members = [("pkg/_aot/k.cubin", b"\x7fELF" + b"\0" * 60), ("pkg/__init__.py", b"")]
    assert audit_members("w.whl", "py3-none-any", members, torch_stable=True).libraries == ()

