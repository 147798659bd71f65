"""``kiln init`` on a torch extension written for the LibTorch stable ABI writes the stable mode with its target.

Real parts: the stableop fixture (STABLE_TORCH_LIBRARY, TORCH_TARGET_VERSION, py_limited_api=True) onboarded by
``init_project`` alone, the written file loaded by Kiln's loader; small source trees for each way a target is
named, and for a package that is not stable-only.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiln.tasks.onboarding import init_project
from kiln.tasks.onboarding.stable import stable_abi, with_stable_abi
from kiln.tasks.project.config import load_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "projects"
_STABLE_OP = "#include <torch/csrc/stable/library.h>\nSTABLE_TORCH_LIBRARY(p, m) { m.def(\"f(Tensor x) -> Tensor\"); }\n"


def _onboarded(name: str, tmp_path: Path) -> Path:
    project = tmp_path / name
    shutil.copytree(FIXTURES / name, project, ignore=shutil.ignore_patterns("__pycache__", ".kiln"))
    (project / "kiln.toml").unlink()
    return init_project(project).path


def test_kiln_init_writes_the_stable_mode_with_the_target_its_sources_name(tmp_path):
    written = _onboarded("stableop", tmp_path)
    text = written.read_text()
    assert 'abi = "stable"' in text and 'torch_target = "2.13"' in text
    assert "STABLE_TORCH_LIBRARY only and builds with py_limited_api" in text  # the header says why
    config = load_config(written)  # the loader accepts it, with the stable mode on every variant
    assert [(v.abi, v.torch_target) for v in config.variants] == [("stable", "2.13")]


def test_an_ordinary_torch_extension_keeps_the_exact_mode(tmp_path):
    written = _onboarded("ember", tmp_path)
    assert "abi =" not in written.read_text()
    assert {v.abi for v in load_config(written).variants} == {"exact"}


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(("files", "target", "why"), [
    ({"csrc/op.cpp": _STABLE_OP + "static_assert(TORCH_TARGET_VERSION == TORCH_VERSION_2_10_0);\n"},
     "2.10", "csrc/op.cpp sets TORCH_TARGET_VERSION"),
    ({"csrc/op.cpp": _STABLE_OP, "setup.py": "extra_compile_args=['-DTORCH_TARGET_VERSION=0x020b000000000000']\n"},
     "2.11", "setup.py sets TORCH_TARGET_VERSION"),
    ({"csrc/op.cpp": _STABLE_OP, "pyproject.toml": '[project]\ndependencies = ["torch>=2.12,<3"]\n'},
     "2.12", "pyproject.toml requires torch>=2.12"),
    ({"csrc/op.cpp": _STABLE_OP}, None, "no torch_target: nothing names one"),
])
def test_the_target_is_read_from_sources_then_requirements(tmp_path, files, target, why):
    found = stable_abi(_tree(tmp_path, files))
    assert found.stable and found.target == target
    assert why in found.reasons[1]
    text = with_stable_abi('# Written\n# Edit freely\n\n[[variants]]\nname = "cpu"\nbackend = "cpu"\n', tmp_path)
    assert ('torch_target = ' in text) == (target is not None) and 'abi = "stable"' in text


def test_a_package_registering_through_torch_library_too_is_not_stable(tmp_path):
    root = _tree(tmp_path, {"csrc/op.cpp": _STABLE_OP, "csrc/old.cpp": "TORCH_LIBRARY(p, m) {}\n"})
    found = stable_abi(root)
    assert not found.stable and "csrc/old.cpp also registers ops through TORCH_LIBRARY" in found.reasons[0]
    text = with_stable_abi('# Written\n# Edit freely\n\n[[variants]]\nname = "cpu"\n', root)
    assert "abi =" not in text and "# Edit freely" in text and "abi exact:" in text


def test_sources_without_the_stable_macro_change_nothing(tmp_path):
    root = _tree(tmp_path, {"csrc/op.cpp": "TORCH_LIBRARY(p, m) {}\n", "build/x.cpp": _STABLE_OP})  # build/: skipped
    text = '# Written\n# Edit freely\n\n[[variants]]\nname = "cpu"\n'
    assert with_stable_abi(text, root) == text
