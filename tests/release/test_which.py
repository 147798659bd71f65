"""kiln which's selection: which wheel of one version fits an environment, or why none does, axis by axis."""

from __future__ import annotations

import sys

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kiln.core.errors import InvalidInputError
from kiln.release.which.environment import Asked, environment, platforms
from kiln.release.which.pick import Backend, Candidate, Choice, Miss, label_backend, select


def wheel(filename: str, requires_python: str | None = ">=3.10", torch: str | None = None,
          archs: tuple[str, ...] | None = None) -> Candidate:
    return Candidate(filename, SpecifierSet(requires_python) if requires_python else None,
                     SpecifierSet(torch) if torch is not None else None, frozenset(archs) if archs else None)


CPU = wheel("kk-0.1.0+cpu-cp311-cp311-linux_x86_64.whl", torch="==2.13.0")
CU130 = wheel("kk-0.1.0+cu130-cp312-cp312-linux_x86_64.whl", torch="==2.14.1", archs=("8.0", "9.0"))
CU126 = wheel("kk-0.1.0+cu126-cp312-cp312-linux_x86_64.whl", torch="==2.14.1")
STABLE = wheel("kk-0.2.0+cu130-cp310-abi3-manylinux_2_17_x86_64.whl", torch=">=2.13")
ROCM = wheel("kk-0.1.0+rocm6.4-cp312-cp312-linux_x86_64.whl", torch="==2.14.1")
PORTABLE = wheel("kk-0.1.0-py3-none-any.whl")
PLATFORM = "manylinux_2_28_x86_64"


def env(python: str = "3.12", torch: str = "2.14.1", cuda: str = "none", rocm: str | None = None,
        arch: str = "none", platform: str = PLATFORM):
    return environment(Asked(python=python, platform=platform, torch=torch, cuda=cuda, rocm=rocm, arch=arch))


CHOSEN = [
    ("cpu, no GPU", dict(python="3.11", torch="2.13.0"), [CPU, CU130], CPU),
    ("CUDA 13.0 and its arch", dict(cuda="13.0", arch="9.0"), [CPU, CU130], CU130),
    ("a newer arch of the same major runs the older cubin", dict(cuda="13.0", arch="8.6"), [CU130], CU130),
    ("CUDA 13.1 runs a 13.0 build", dict(cuda="13.1"), [CPU, CU130], CU130),
    ("the newest CUDA build the driver runs", dict(cuda="13.0"), [CU126, CU130], CU130),
    ("CUDA 12.8 takes the 12.6 build", dict(cuda="12.8"), [CU126, CU130], CU126),
    ("ROCm", dict(cuda="none", rocm="6.4"), [CPU, ROCM, CU130], ROCM),
    ("abi3 stable-ABI wheel under a newer Python and torch", dict(python="3.13", torch="2.15.0", cuda="13.0"),
     [STABLE], STABLE),
    ("older manylinux on a newer glibc", dict(python="3.12", cuda="13.0"), [STABLE], STABLE),
    ("no torch installed: the pinned one comes with it", dict(python="3.11", torch="none"), [CPU], CPU),
    ("cpu before a portable wheel", dict(python="3.11", torch="2.13.0"), [PORTABLE, CPU], CPU),
    ("a GPU machine with only a portable wheel", dict(cuda="13.0"), [PORTABLE, CPU], PORTABLE),
]


@pytest.mark.parametrize(("case", "axes", "candidates", "expected"), CHOSEN, ids=[c[0] for c in CHOSEN])
def test_select_chooses_the_wheel_that_fits(case: str, axes: dict[str, str], candidates: list[Candidate],
                                             expected: Candidate) -> None:
    answer = select(env(**axes), candidates)
    assert isinstance(answer, Choice), answer
    assert answer.candidate == expected


MISSED = [
    ("torch", dict(torch="2.12", cuda="13.0"), [CPU, CU130],
     ["no wheel for torch 2.12: kk 0.1.0+cu130 requires torch==2.14.1"]),
    ("torch below a stable-ABI floor", dict(torch="2.12", cuda="13.0"), [STABLE],
     ["no wheel for torch 2.12: this release covers torch>=2.13 (stable ABI)"]),
    ("torch below every stable wheel's floor: the lowest is said",
     dict(torch="2.12", cuda="13.0"), [STABLE, wheel("kk-0.2.0+cu130-py3-none-manylinux_2_17_x86_64.whl",
                                                     torch=">=2.14")],
     ["no wheel for torch 2.12: this release covers torch>=2.13 (stable ABI)"]),
    ("torch series pins are not a stable floor", dict(python="3.11", torch="2.12"),
     [wheel("kk-0.1.0+cpu-cp311-cp311-linux_x86_64.whl", torch="==2.13.*")],
     ["no wheel for torch 2.12: kk 0.1.0+cpu requires torch==2.13.*"]),
    ("requires-python", dict(python="3.9", torch="2.13.0"), [CPU],
     ["no wheel for Python 3.9: kk 0.1.0+cpu requires-python >=3.10", "no cp39 wheel: the index has cp311 only"]),
    ("interpreter", dict(python="3.13", cuda="13.0"), [CPU, CU130],
     ["no cp313 wheel: the index has cp311, cp312 only"]),
    ("platform", dict(cuda="13.0", platform="manylinux_2_28_aarch64"), [CU130],
     ["no wheel for platform manylinux_2_28_aarch64: the index has linux_x86_64 only"]),
    ("manylinux newer than the system's glibc", dict(cuda="13.0", platform="manylinux_2_12_x86_64"), [STABLE],
     ["no wheel for platform manylinux_2_12_x86_64: the index has manylinux_2_17_x86_64 only"]),
    ("CUDA major", dict(cuda="12.8"), [CPU, CU130],
     ["no wheel for CUDA 12.8: kk 0.1.0 has +cpu (no GPU backend (cpu)), +cu130 (CUDA 13.0)"]),
    ("CUDA minor below the build's", dict(cuda="13.0"), [wheel("kk-0.1.0+cu132-cp312-cp312-linux_x86_64.whl")],
     ["no wheel for CUDA 13.0: kk 0.1.0 has +cu132 (CUDA 13.2)"]),
    ("cpu wanted, only GPU builds", dict(), [CU130],
     ["no wheel for no GPU backend (cpu): kk 0.1.0 has +cu130 (CUDA 13.0)"]),
    ("arch", dict(cuda="13.0", arch="7.5"), [CU130], ["no wheel for arch 7.5: kk 0.1.0+cu130 is built for 8.0, 9.0"]),
    ("nothing at all", dict(), [], ["the index has no wheel of that version"]),
]


@pytest.mark.parametrize(("case", "axes", "candidates", "reasons"), MISSED, ids=[c[0] for c in MISSED])
def test_select_names_the_closest_miss_per_axis(case: str, axes: dict[str, str], candidates: list[Candidate],
                                                reasons: list[str]) -> None:
    answer = select(env(**axes), candidates)
    assert isinstance(answer, Miss), answer
    assert list(answer.reasons) == reasons


def test_a_choice_says_what_it_could_not_check() -> None:
    answer = select(env(torch="none", cuda="12.8", arch="9.0"), [CU126])
    assert isinstance(answer, Choice)
    assert answer.unchecked == ("no torch here: installing it brings torch==2.14.1",
                                f"arch 9.0 not checked: the index does not say which archs {CU126.filename} has")


@pytest.mark.parametrize(("label", "backend"), [
    ("cu130", Backend("cuda", Version("13.0"))), ("cu128", Backend("cuda", Version("12.8"))),
    ("cu130torch2.14", Backend("cuda", Version("13.0"))), ("rocm6.4", Backend("hip", Version("6.4"))),
    ("cpu", Backend("cpu")), ("cputorch2.13", Backend("cpu")), (None, Backend("any")), ("any", Backend("any")),
])
def test_local_label_names_the_backend(label: str | None, backend: Backend) -> None:
    assert label_backend(label) == backend


def test_manylinux_platform_accepts_every_older_manylinux() -> None:
    assert platforms("manylinux_2_17_x86_64")[:2] == ["manylinux_2_17_x86_64", "manylinux2014_x86_64"]
    assert platforms("manylinux_2_17_x86_64")[-3:] == ["manylinux_2_5_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    assert platforms("macosx_14_0_arm64") == ["macosx_14_0_arm64"]


@pytest.mark.parametrize(("asked", "named"), [
    (Asked(python="three", torch="none", cuda="none", arch="none"), "--python 'three'"),
    (Asked(python="3.12", torch="2.x", cuda="none", arch="none"), "--torch '2.x'"),
    (Asked(python="3.12", torch="none", cuda="thirteen", arch="none"), "--cuda 'thirteen'"),
    (Asked(python="3.12", torch="none", cuda="13.0", rocm="6.4", arch="none"), "--cuda 13.0 and --rocm 6.4"),
    (Asked(python="3.12", torch="none", cuda="none", arch="sm_90"), "--arch 'sm_90'"),
    (Asked(python="3.12", torch="none", cuda="none", arch="none", platform="many linux"), "--platform 'many linux'"),
])
def test_bad_environment_values_are_refused_by_name(asked: Asked, named: str) -> None:
    with pytest.raises(InvalidInputError, match=named):
        environment(asked)


def test_the_running_environment_is_the_default() -> None:
    from packaging import tags

    found = environment(Asked(torch="none", cuda="none", arch="none"))
    assert found.tags == tuple(tags.sys_tags())
    assert (found.python.major, found.python.minor) == sys.version_info[:2]
    assert found.torch is None and found.backend == Backend("cpu") and found.arch is None


def test_the_installed_torch_gives_the_default_torch_backend_and_arch() -> None:
    torch = pytest.importorskip("torch")
    found = environment(Asked(python="3.12", platform=PLATFORM))
    assert found.torch == Version(torch.__version__)
    if torch.version.cuda:
        assert found.backend == Backend("cuda", Version(torch.version.cuda))
    elif not getattr(torch.version, "hip", None):
        assert found.backend == Backend("cpu")
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    assert found.arch == (f"{capability[0]}.{capability[1]}" if capability else None)
