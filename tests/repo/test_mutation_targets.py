"""benchmarks/mutation.py names real functions: the mutation run is not in CI (hours), so a rename or a
deletion in a guarded module would otherwise end it early, unnoticed, on the next person's run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _mutation():
    spec = importlib.util.spec_from_file_location("kiln_mutation_bench", REPO / "benchmarks" / "mutation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


MUTATION = _mutation()


@pytest.mark.parametrize("module", MUTATION.MODULES, ids=lambda m: m.name)
def test_every_guarded_function_and_test_file_exists(module):
    assert len(MUTATION.function_lines(REPO / module.path, module.functions)) == len(module.functions)
    files = [test.split("::")[0] for test in module.tests if test.split("::")[0].endswith(".py")]
    assert files and all((REPO / name).is_file() for name in files), module.tests
