"""kiln which over a matrix's wheels (issue 45, part 5): each Python and torch finds its own cell's wheel."""

from __future__ import annotations

import pytest

from kiln.release.which.pick import Choice, Miss, select
from tests.release.test_which import env, wheel

PY = {p: wheel(f"cmatrix-1.0.0+cpu-cp3{p}-cp3{p}-manylinux_2_5_x86_64.whl") for p in ("10", "11", "12", "13")}
TORCH = {t: wheel(f"ops-1.0.0+cu130torch{t}-cp312-cp312-manylinux_2_28_x86_64.whl", torch=f"=={t}.*")
         for t in ("2.13", "2.14")}


@pytest.mark.parametrize("python", ["3.10", "3.11", "3.12", "3.13"])
def test_each_python_finds_its_cells_wheel(python):
    chosen = select(env(python=python, torch="2.14.1"), list(PY.values()))
    assert isinstance(chosen, Choice) and chosen.candidate == PY[python.split(".")[1]]


def test_a_python_the_matrix_left_out_is_told_which_pythons_it_covers():
    missed = select(env(python="3.9", torch="2.14.1"), list(PY.values()))
    assert isinstance(missed, Miss)
    assert any("3.9" in reason or "cp39" in reason for reason in missed.reasons), missed.reasons


@pytest.mark.parametrize(("torch", "label"), [("2.13.0", "2.13"), ("2.14.1", "2.14")])
def test_each_torch_finds_the_wheel_of_its_torch_label(torch, label):
    chosen = select(env(python="3.12", torch=torch, cuda="13.0"), list(TORCH.values()))
    assert isinstance(chosen, Choice) and chosen.candidate == TORCH[label]
