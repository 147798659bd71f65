"""The ``cuda`` matrix axis, one entry of the axis table: cells named and labelled by CUDA release, excluded and
selected by pattern, and each cell's Triton kernels assembled by its release's ptxas (the machine's toolkit for
13.0, NVIDIA's ``nvidia-cuda-nvcc-cu12`` wheel from the index for 12.8: a real download, cached per machine)."""

from __future__ import annotations

import re
import shutil
import zipfile

import pytest

from kiln.core.errors import CompileError, ConfigError
from kiln.tasks.build.cache import BuildCache
from kiln.tasks.build.cuda_toolkits import toolkits_root, tools, wheel_requirements
from kiln.tasks.build.pool import WorkerPool
from kiln.tasks.build.stage import prepare_build, worker_config
from kiln.tasks.build.units import CompileContext, build_unit
from kiln.tasks.project.config import load_config
from kiln.tasks.project.config_axes import AXES
from tests.helpers.projects import copy_project

_AXIS = 'name = "gpu"\nbackend = "cuda"\narchs = ["8.0", "9.0"]\ncuda = ["13.0", "12.8"]\n'


def _project(tmp_path, extra: str = ""):
    config = copy_project("tiny", tmp_path / "tiny")
    text = config.read_text().replace('name = "cu130"\nbackend = "cuda"\narchs = ["8.0", "9.0"]\n', _AXIS + extra)
    assert text != config.read_text()
    config.write_text(text)
    return config


def test_the_cuda_axis_is_one_entry_of_the_table():
    assert [a.key for a in AXES] == ["python", "torch", "cuda", "platform"]
    cuda = next(a for a in AXES if a.key == "cuda")
    assert cuda.toolchain == "kiln.tasks.build.cuda_toolkits:toolchain_env"
    assert wheel_requirements("12.8") == ["nvidia-cuda-nvcc-cu12==12.8.*"]  # ptxas and NVVM only
    assert wheel_requirements("13.2") == ["nvidia-cuda-nvcc==13.2.*", "nvidia-nvvm==13.2.*", "nvidia-cuda-crt==13.2.*",
                                          "nvidia-cuda-runtime==13.2.*"]


def test_cuda_cells_are_named_and_labelled_by_release_and_excluded_by_pattern(tmp_path):
    config = load_config(_project(tmp_path / "a"))
    cells = {v.name: v for v in config.variants if v.cell is not None}
    assert sorted(cells) == ["gpucu128", "gpucu130"]  # sorted by release whatever kiln.toml's order
    assert cells["gpucu128"].label == "gpucu128" and cells["gpucu128"].cell.value("cuda") == "12.8"
    assert cells["gpucu128"].cuda == () and cells["gpucu128"].archs == ("8.0", "9.0")
    left = load_config(_project(tmp_path / "b", 'exclude = ["*cu128"]\n'))
    assert [v.name for v in left.variants if v.cell is not None] == ["gpucu130"]
    both = load_config(_project(tmp_path / "c", 'python = ["3.11", "3.12"]\nexclude = [{python = "3.12", cuda = '
                                                '"12.8"}, "gpupy311cu130"]\n'))
    assert [v.name for v in both.variants if v.cell is not None] == ["gpupy311cu128", "gpupy312cu130"]


@pytest.mark.parametrize(("extra", "message"), [
    ('exclude = [{cuda = "12.9"}]\n', r"exclude\[0\]\.cuda = '12\.9' matches no cell: the variant's cuda axis is"),
    ('exclude = [{cdua = "12.8"}]\n', r"names \['cdua'\], not an axis: the axes are \['python', 'torch', 'cuda'"),
])
def test_a_bad_exclusion_is_refused_naming_it(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(_project(tmp_path, extra))


def test_a_cuda_axis_on_a_variant_that_compiles_no_cuda_is_refused(tmp_path):
    config = _project(tmp_path)
    config.write_text(config.read_text().replace('name = "cpu"\nbackend = "cpu"\n', 'name = "cpu"\nbackend = "cpu"\n'
                                                                                   'cuda = ["12.8"]\n'))
    with pytest.raises(ConfigError, match=r"variant 'cpu': cuda = \['12\.8'\] is the CUDA release .* backend 'cpu'"):
        load_config(config)


def test_a_bad_cuda_release_is_refused_naming_it(tmp_path):
    config = _project(tmp_path)
    config.write_text(config.read_text().replace('cuda = ["13.0", "12.8"]', 'cuda = ["13", "12.8"]'))
    with pytest.raises(ConfigError, match=r"variants\[0\]\.cuda: '13' is not a CUDA release 'major\.minor'"):
        load_config(config)


def _ptx_isa(cubin: bytes) -> str:
    """The PTX ISA of the PTX ``cubin`` was assembled from (Triton keeps it in the cubin's debug section): Triton
    writes the newest its ptxas takes, 8.7 for CUDA 12.8's, 9.0 for 13.0's."""
    found = re.search(rb"\.version (\d+\.\d+)", cubin)
    assert found, "the cubin holds no PTX text"
    return found[1].decode()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed (the 13.0 cell's ptxas)")
def test_each_cuda_cell_is_assembled_by_its_release_s_ptxas(tmp_path):
    assert tools("13.0")["ptxas"].is_file()  # this machine's toolkit is 13.0: no download for that cell
    setup = prepare_build(str(_project(tmp_path)), "0.1.0", None)
    base = str(tmp_path)
    (tmp_path / "triton").mkdir()
    releases = {}
    with WorkerPool(1, {"TRITON_INTERPRET": None, "TRITON_CACHE_DIR": str(tmp_path / "triton")},
                    read=(base, str(toolkits_root())), write=(base,)) as pool:
        # one worker, the releases in turn, each with a build cache of its own: Triton's own cache in the
        # worker must not hand the 12.8 cell the cubin it made for 13.0
        for index, cell in enumerate(("gpucu128", "gpucu130", "gpucu128")):
            env = CompileContext(worker_config(setup), tmp_path / f"out{index}" / "build",
                                 BuildCache(tmp_path / f"cache{index}"), pool, 300, setup.plan.toolchain,
                                 config=setup.config)
            unit = next(u for u in setup.plan.units if u.variant == cell and u.arch == "9.0" and u.kind == "triton")
            result = build_unit(unit, env)
            assert result.cache == "miss"
            cubin = next(p for p in result.files if p.suffix == ".cubin").read_bytes()
            releases.setdefault(cell, set()).add(_ptx_isa(cubin))
        keys = {u.variant: u.key for u in setup.plan.units if u.arch == "9.0" and u.kind == "triton"}
    assert releases == {"gpucu128": {"8.7"}, "gpucu130": {"9.0"}}
    assert keys["gpucu128"] != keys["gpucu130"]  # cached apart


_PROBE = ('\n#define KILN_S2(x) #x\n#define KILN_S(x) KILN_S2(x)\nextern "C" const char kiln_nvcc[] = "nvcc-"'
          ' KILN_S(__CUDACC_VER_MAJOR__) "." KILN_S(__CUDACC_VER_MINOR__);\n')


def _plaincuda(tmp_path, releases: str):
    """The plain CUDA library (setup.py runs nvcc), its source saying which nvcc compiled it."""
    config = copy_project("plaincuda", tmp_path / "plaincuda")
    config.write_text(config.read_text().replace('archs = ["8.0", "9.0"]\n', f'archs = ["9.0"]\ncuda = {releases}\n'))
    source = config.parent / "csrc" / "fill.cu"
    source.write_text(source.read_text() + _PROBE)
    return config


def _compiled_by(files) -> set[str]:
    """The nvcc releases the built wheel's libraries say compiled them."""
    found = set()
    for path in files:
        members = zipfile.ZipFile(path).namelist() if path.suffix == ".whl" else []
        datas = [zipfile.ZipFile(path).read(m) for m in members] if members else [path.read_bytes()]
        found |= {m.decode() for data in datas for m in re.findall(rb"nvcc-(\d+\.\d+)", data)}
    return found


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed (the 13.0 cell's toolkit)")
def test_a_plain_cuda_library_is_compiled_by_each_cells_nvcc_the_other_release_from_nvidia_s_wheels(tmp_path):
    from kiln.tasks.build.stage import compile_context

    setup = prepare_build(str(_plaincuda(tmp_path, '["13.0", "13.2"]')), "1.0.0", None)
    compiled = {}
    with compile_context(setup, tmp_path / "out") as env:
        for cell in ("cu130cu130", "cu130cu132"):
            unit = next(u for u in setup.plan.units if u.variant == cell)
            compiled[cell] = _compiled_by(build_unit(unit, env).files)
    assert compiled == {"cu130cu130": {"13.0"}, "cu130cu132": {"13.2"}}  # 13.2: nvcc from the staged wheels
    assert (toolkits_root() / "cuda-13.2" / "bin" / "nvcc").is_file()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_a_native_build_of_a_release_whose_wheels_hold_no_nvcc_is_refused_naming_why(tmp_path):
    from kiln.tasks.build.stage import compile_context

    setup = prepare_build(str(_plaincuda(tmp_path, '["12.8"]')), "1.0.0", None)
    unit = next(u for u in setup.plan.units if u.variant == "cu130cu128")
    with compile_context(setup, tmp_path / "out") as env, pytest.raises(CompileError) as info:
        build_unit(unit, env)
    assert "CUDA 12.8: this machine's nvcc is 13.0" in str(info.value)
    assert "hold no nvcc (ptxas only)" in str(info.value) and "drop 12.8 from the variant's cuda axis" in str(info.value)
