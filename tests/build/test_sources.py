"""A kernel's source closure: its module and the package modules it imports."""

from __future__ import annotations

import pytest

from kiln.core.errors import ConfigError
from kiln.tasks.build.sources import source_closure


def _write(root, files):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_closure_follows_module_level_package_imports_only(tmp_path):
    pkg = tmp_path / "pk"
    _write(pkg, {
        "__init__.py": "from pk import a, b\n",  # re-exports everything: bytes count, imports do not
        "a.py": "import os\nfrom pk import _common\nfrom . import _rel\n",
        "_common.py": "X = 1\n",
        "_rel.py": "from pk.sub import deep\n",
        "sub/__init__.py": "",
        "sub/deep.py": "",
        "b.py": "def lazy():\n    from pk import _runtime_only\n",
        "_runtime_only.py": "",
    })
    names = [p.relative_to(pkg).as_posix() for p in source_closure(pkg, "pk", "pk.a")]
    assert names == ["__init__.py", "_common.py", "_rel.py", "a.py", "sub/__init__.py", "sub/deep.py"]
    assert [p.name for p in source_closure(pkg, "pk", "pk.b")] == ["__init__.py", "b.py"]


def test_module_outside_the_package_is_a_config_error(tmp_path):
    (tmp_path / "pk").mkdir()
    with pytest.raises(ConfigError, match="not a module of package 'pk'"):
        source_closure(tmp_path / "pk", "pk", "other.mod")
