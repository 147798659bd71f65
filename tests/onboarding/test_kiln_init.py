"""kiln init: the kiln.toml it writes for each kind of package loads with Kiln's own loader and says what it
inferred; it never overwrites a kiln.toml and refuses a directory that is no Python package. Also the config
rules of the pure-Triton kind and the bench stage's 'not run' reasons (pure functions, no flow)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiln.core.errors import ConfigError
from kiln.flows.cli import main
from kiln.tasks.bench.harness import bench_skip
from kiln.tasks.onboarding import OnboardingError, init_project
from kiln.tasks.onboarding.defaults import load_defaults
from kiln.tasks.project.config import load_config, parse_config
from tests.helpers.gitrepo import FIXTURES


def _package(name: str, dest: Path) -> Path:
    """The fixture as a team has it before Kiln: no kiln.toml."""
    repo = dest / name
    shutil.copytree(FIXTURES / name, repo, ignore=shutil.ignore_patterns("__pycache__", ".kiln", "kiln.toml"))
    return repo


# fixture -> (kind, distribution, {variant: (backend, archs, build_requires)}, {suite: (gpus, markers)})
_EXPECTED = {
    "acme": ("registry", "acme", {"cu130": ("cuda", ("8.0", "9.0"), ()), "cpu": ("cpu", (), ())},
             {"unit": (0, "")}),
    "tiny": ("registry", "tinyk", {"cu130": ("cuda", ("8.0", "9.0"), ()), "cpu": ("cpu", (), ())},
             {"unit": (0, "")}),
    "ember": ("pep517", "ember-ops", {"cu130": ("cuda", ("9.0",), ("torch==2.14.1",)), "cpu": ("cpu", (), ())},
              {"unit": (0, "")}),
    "plaincuda": ("pep517", "plaincuda", {"cu130": ("cuda", ("9.0",), ()), "cpu": ("cpu", (), ())}, {}),
    "jitk": ("triton-jit", "jit-kernels", {"any": ("cpu", (), ())}, {"unit": (0, "not gpu"), "gpu": (1, "gpu")}),
}


@pytest.mark.parametrize("fixture", sorted(_EXPECTED))
def test_kiln_init_writes_a_kiln_toml_kilns_loader_accepts_for_each_kind_of_package(fixture, tmp_path, capsys):
    kind, distribution, variants, suites = _EXPECTED[fixture]
    repo = _package(fixture, tmp_path)
    assert main(["init", str(repo)]) == 0
    printed = capsys.readouterr().out
    assert f"is a {kind} package" in printed and f"kind {kind}:" in printed and "wrote " in printed
    config = load_config(repo / "kiln.toml")
    assert config.project.distribution == distribution
    assert config.build.backend == ("kiln" if kind == "registry" else "pep517")
    assert config.build.kind == ("triton-jit" if kind == "triton-jit" else "native")
    assert {v.name: (v.backend, v.archs, v.build_requires) for v in config.variants} == variants
    assert {s.name: (s.gpus, s.markers) for s in config.suites} == suites
    assert config.build.toolchain.torch == (fixture == "ember")  # a torch extension pins the torch it built with
    text = (repo / "kiln.toml").read_text()
    assert text.startswith("# Written by `kiln init`") and "why:" in text.splitlines()[0]


def test_kiln_init_registry_package_keeps_its_runtime_dependency_and_registry(tmp_path):
    result = init_project(_package("acme", tmp_path))
    config = load_config(result.path)
    assert config.project.registry == "acme.registry:registry" and config.project.source == "src/acme"
    assert config.project.dependencies == ("kiln-runtime",)  # acme launches through kiln.runtime's loader


def test_kiln_init_pure_triton_cpu_suite_runs_through_the_interpreter_with_numpy(tmp_path):
    result = init_project(_package("jitk", tmp_path))
    unit = load_config(result.path).suites_by_name["unit"]
    assert unit.requires == tuple(load_defaults().interpreter_requires) == ("numpy",)
    gpu = load_config(result.path).suites_by_name["gpu"]
    assert gpu.publish_untested  # not run without a GPU: published marked untested, as the comment says
    assert any("src/jitk/add.py uses Triton" in reason for reason in result.findings.reasons)


def test_kiln_init_never_overwrites_an_existing_kiln_toml(tmp_path, capsys):
    repo = _package("ember", tmp_path)
    shutil.copy(FIXTURES / "ember" / "kiln.toml", repo / "kiln.toml")
    before = (repo / "kiln.toml").read_bytes()
    assert main(["init", str(repo)]) == 2
    assert "already exists; kiln init never overwrites it" in capsys.readouterr().err
    assert (repo / "kiln.toml").read_bytes() == before


@pytest.mark.parametrize("layout", ["empty", "docs only", "loose module"])
def test_kiln_init_on_a_directory_that_is_no_python_package_says_so_and_writes_nothing(layout, tmp_path, capsys):
    if layout == "docs only":
        (tmp_path / "README.md").write_text("# notes\n")
        (tmp_path / "docs").mkdir()
    if layout == "loose module":
        (tmp_path / "script.py").write_text("print('hi')\n")
    assert main(["init", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds no Python package" in err and "run kiln init in the repository of a Python package" in err
    assert not (tmp_path / "kiln.toml").exists()


def test_kiln_init_on_a_missing_directory_is_refused_and_a_setup_py_alone_is_accepted(tmp_path):
    with pytest.raises(OnboardingError, match="is not a directory"):
        init_project(tmp_path / "nowhere")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("import triton\n")
    (tmp_path / "setup.py").write_text("from setuptools import setup\nsetup(name='pkg', version='1.0')\n")
    config = load_config(init_project(tmp_path).path)  # pip builds it through setuptools' legacy backend
    assert config.build.backend == "pep517" and config.project.distribution == "pkg"


# fixture -> (distribution, import package, variants, the GPU variant's build_env, a reason kiln init gives)
_BUILDS = {
    "cudaonly": ("cuda_only_ops", "coops", ["cu130"], {"CUDA_ONLY_OPS_FORCE_BUILD": "TRUE"},
                 "no CPU variant: setup.py builds a CUDAExtension and no CppExtension"),
    "forcecuda": ("force-cuda-ops", "fcops", ["cu130", "cpu"], {"FORCE_CUDA": "1"},
                  "build_env FORCE_CUDA=1: setup.py compiles its CUDA code only when it sees a GPU"),
    "cpponly": ("cpp-only-ops", "cppops", ["cpu"], {}, "no GPU variant: setup.py builds a CppExtension and no"),
}


@pytest.mark.parametrize("fixture", sorted(_BUILDS))
def test_kiln_init_gives_each_variant_the_build_can_make_with_the_switches_it_needs(fixture, tmp_path):
    distribution, package, variants, env, reason = _BUILDS[fixture]
    result = init_project(_package(fixture, tmp_path))
    config = load_config(result.path)
    assert (config.project.distribution, config.project.package) == (distribution, package)
    assert [v.name for v in config.variants] == variants
    gpu = [v for v in config.variants if v.backend == "cuda"]
    assert (gpu[0].build_env if gpu else {}) == env
    assert any(r.startswith(reason) for r in result.findings.reasons), result.findings.reasons


def test_kiln_init_reads_the_distribution_from_setup_never_from_the_extension_module(tmp_path):
    """cudaonly: setup(name=PACKAGE_NAME) through a module constant; CUDAExtension(name="cuda_only_ops_C") and
    the import package coops are other names; setup.py only; its requires-python from python_requires."""
    result = init_project(_package("cudaonly", tmp_path))
    config = load_config(result.path)
    assert config.project.distribution == "cuda_only_ops" and config.project.source == "coops"
    assert config.project.requires_python == ">=3.9" and config.project.version == "0.3.1"
    assert "distribution 'cuda_only_ops': setup.py setup(name=...)" in result.findings.reasons
    assert "CUDA_ONLY_OPS_SKIP_CUDA_BUILD makes a wheel without its kernels (for sdists): no CPU variant" in (
        result.findings.reasons)
    assert "# its build switches" in result.text and "own setup.py (setuptools' legacy backend) builds" in result.text
    unit = config.suites_by_name["unit"]  # no CPU build: even its CPU-looking tests need the GPU wheel and a GPU
    assert unit.gpus == 1 and unit.publish_untested


@pytest.mark.parametrize(("source", "where"), [
    ("setup.cfg", "setup.cfg [metadata] name"),
    ("PKG-INFO", "PKG-INFO Name:"),
    ("pyproject", "pyproject.toml [project] name"),
])
def test_kiln_init_reads_the_distribution_name_where_the_ecosystem_keeps_it(source, where, tmp_path):
    (tmp_path / "src" / "imp").mkdir(parents=True)
    (tmp_path / "src" / "imp" / "__init__.py").write_text("")
    (tmp_path / "setup.py").write_text("from setuptools import setup, Extension\n"
                                       "setup(ext_modules=[Extension(name='imp_native', sources=['x.c'])])\n")
    files = {"setup.cfg": ("setup.cfg", "[metadata]\nname = real-name\nversion = 1.0\n"),
             "PKG-INFO": ("PKG-INFO", "Metadata-Version: 2.1\nName: real-name\nVersion: 1.0\n"),
             "pyproject": ("pyproject.toml", '[project]\nname = "real-name"\nversion = "1.0"\n')}
    name, text = files[source]
    (tmp_path / name).write_text(text)
    result = init_project(tmp_path)
    assert result.findings.distribution == "real-name" and result.findings.package == "imp"
    assert f"distribution 'real-name': {where}" in result.findings.reasons


def test_kiln_init_takes_c_extensions_declared_in_pyproject_for_native_code(tmp_path):
    (tmp_path / "fastc").mkdir()
    (tmp_path / "fastc" / "__init__.py").write_text("")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "fastc"\nversion = "1.0"\n[tool.setuptools]\n'
                                             'ext-modules = [{name = "fastc._c", sources = ["fastc/c.c"]}]\n')
    result = init_project(tmp_path)
    assert result.findings.kind == "pep517"
    assert any("[tool.setuptools] ext-modules" in r for r in result.findings.reasons)


def test_kiln_init_finds_the_import_package_where_package_dir_puts_it_and_packages_names_it(tmp_path):
    (tmp_path / "python" / "deep_ops").mkdir(parents=True)
    (tmp_path / "python" / "deep_ops" / "__init__.py").write_text("import triton\n@triton.jit\ndef k(): pass\n")
    (tmp_path / "setup.py").write_text("from setuptools import setup\nsetup(name='deep-kernels', version='1.0',"
                                       " package_dir={'': 'python'}, packages=['deep_ops'])\n")
    (tmp_path / "python" / "helpers").mkdir()
    (tmp_path / "python" / "helpers" / "__init__.py").write_text("")  # first by name, but not what it ships
    result = init_project(tmp_path)
    assert result.findings.source == "python/deep_ops" and result.findings.package == "deep_ops"
    assert "setup.py package_dir = 'python': python/deep_ops/ (the package its build config lists)" in (
        result.findings.reasons)


def _jit_config(tmp_path: Path, build: str, variants: str = "") -> dict:
    import tomllib

    (tmp_path / "src" / "p").mkdir(parents=True, exist_ok=True)
    (tmp_path / "pyproject.toml").write_text("[build-system]\nrequires = [\"setuptools\"]\n")
    variants = variants or '[[variants]]\nname = "any"\nbackend = "cpu"\n'
    return tomllib.loads(f'[project]\npackage = "p"\ndistribution = "p"\nversion = "1.0"\nsource = "src/p"\n'
                         f'{variants}\n[build]\n{build}\n[publish.targets.local]\nurl = "file://{{out}}/i"\n'
                         '[publish]\ndefault_target = "local"\n')


def test_the_package_kind_is_a_closed_set_checked_at_load_with_a_did_you_mean(tmp_path):
    with pytest.raises(ConfigError, match=r"build.kind: 'triton_jit' is not a package kind .*did you mean 'triton-jit'"):
        parse_config(_jit_config(tmp_path, 'backend = "pep517"\nkind = "triton_jit"'), tmp_path)
    config = parse_config(_jit_config(tmp_path, 'backend = "pep517"\nkind = "triton-jit"'), tmp_path)
    assert config.build.kind == "triton-jit" and [v.name for v in config.variants] == ["any"]


@pytest.mark.parametrize(("build", "variants", "problem"), [
    ('kind = "triton-jit"', "", 'set \\[build\\] backend = "pep517"'),
    ('backend = "pep517"\nkind = "triton-jit"',
     '[[variants]]\nname = "cu130"\nbackend = "cuda"\narchs = ["9.0"]\n[[variants]]\nname = "cpu"\nbackend = "cpu"\n',
     "exactly one \\[\\[variants\\]\\] with backend = \"cpu\""),
])
def test_a_triton_jit_package_is_one_portable_wheel_built_by_its_own_backend(tmp_path, build, variants, problem):
    with pytest.raises(ConfigError, match=problem):
        parse_config(_jit_config(tmp_path, build, variants), tmp_path)


def test_the_bench_stage_is_not_run_for_a_gpu_only_package_here_or_when_switched_off(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine benchmarks a GPU variant")
    gpu_only = '[[variants]]\nname = "cu130"\nbackend = "cuda"\narchs = ["9.0"]\n'
    config = parse_config(_jit_config(tmp_path, 'backend = "pep517"', gpu_only), tmp_path)
    assert bench_skip(config).startswith("not run: no variant of kiln.toml runs on this machine (cpu);"
                                         " its variants are cu130 (cuda)")
    config = parse_config(_jit_config(tmp_path, 'backend = "pep517"') | {"bench": {"enabled": False}}, tmp_path)
    assert bench_skip(config) == "not run: the bench stage is switched off ([bench] enabled = false in kiln.toml)"
    assert bench_skip(parse_config(_jit_config(tmp_path, 'backend = "pep517"'), tmp_path)) == ""


def _readme_examples() -> list[str]:
    readme = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "onboarding.md").read_text()
    section = readme.split("## Onboarding: kiln init", 1)[1].split("\n## ", 1)[0]
    import re

    return re.findall(r"```toml\n(.*?)```", section, flags=re.S)


@pytest.mark.parametrize(("index", "fixture"), [(0, "tiny"), (1, "ember"), (2, "jitk")])
def test_the_readme_kiln_init_examples_are_what_kiln_init_writes(index, fixture, tmp_path):
    written = init_project(_package(fixture, tmp_path)).text
    lines = {line.split("#", 1)[0].strip() for line in written.splitlines()}
    example = [line.strip() for line in _readme_examples()[index].splitlines() if line.strip()]
    assert [line for line in example if line not in lines] == []


def test_kiln_init_puts_a_final_release_below_the_nightlies(tmp_path):
    result = init_project(_package("jitk", tmp_path))
    assert load_config(result.path).project.version == "0.4.1"  # the package declares 0.4.0
    assert any(r.startswith("version 0.4.1: the package declares 0.4.0") for r in result.findings.reasons)


def test_kiln_init_lets_a_package_that_hard_codes_its_archs_through_and_sees_a_cmake_torch_build(tmp_path):
    def own_archs(repo: Path) -> None:
        setup = repo / "setup.py"
        setup.write_text(setup.read_text().replace(
            '"csrc/fill.cu", *gencode(archs)]', '"csrc/fill.cu", "-gencode", "arch=compute_80,code=sm_80"]'))

    plain = _package("plaincuda", tmp_path / "a")
    assert load_config(init_project(plain).path).variant("cu130").arch_policy == "exact"  # it uses Kiln's archs
    hard = _package("plaincuda", tmp_path / "b")
    own_archs(hard)
    result = init_project(hard)
    assert load_config(result.path).variant("cu130").arch_policy == "narrow"  # Kiln's nvcc keeps the variant's
    assert any(r.startswith("arch_policy narrow: setup.py names its own CUDA archs") for r in result.findings.reasons)
    cmake = tmp_path / "c"
    (cmake / "src" / "ops").mkdir(parents=True)
    (cmake / "src" / "ops" / "__init__.py").write_text("")
    (cmake / "pyproject.toml").write_text('[build-system]\nrequires = ["scikit-build-core"]\n'
                                          'build-backend = "scikit_build_core.build"\n[project]\nname = "ops"\n'
                                          'version = "2.0.0rc1"\n')
    (cmake / "CMakeLists.txt").write_text("find_package(Torch REQUIRED)\n")
    config = load_config(init_project(cmake).path)
    assert config.variant("cu130").build_requires == ("torch==2.14.1",) and config.build.toolchain.torch
    assert config.project.version == "2.0.0rc1"  # a pre-release stays the nightly base


@pytest.mark.parametrize(("setup_py", "env", "reason"), [
    ('FORCE_BUILD = os.getenv("FA_FORCE_BUILD", "FALSE") == "TRUE"\n', (("FA_FORCE_BUILD", "TRUE"),),
     "build_env FA_FORCE_BUILD=TRUE: unless it is set"),
    ('force = os.environ.get("X_FORCE_BUILD", "0") == "1"\n', (("X_FORCE_BUILD", "1"),), "build_env X_FORCE_BUILD=1"),
    ("class C(bdist_wheel):\n    def run(self):\n        urllib.request.urlretrieve(URL, 'w.whl')\n", (),
     "setup.py may download during the build and names no *_FORCE_BUILD switch"),
    ("if os.getenv('FORCE_CUDA', '0') == '1':\n    WITH_CUDA = True\n", (("FORCE_CUDA", "1"),),
     "build_env FORCE_CUDA=1: setup.py compiles its CUDA code only when it sees a GPU"),
    ("if os.getenv('FORCE_ONLY_CUDA', '0') == '1':\n    pass\n", (), None),  # a choice of the CPU part, no GPU switch
])
def test_kiln_init_reads_the_build_switches_a_setup_py_reads(setup_py, env, reason):
    from kiln.tasks.onboarding.names import parse_setup_py
    from kiln.tasks.onboarding.switches import read_switches

    switches = read_switches(setup_py, parse_setup_py(setup_py))
    assert switches.gpu_env == env
    assert [r for r in switches.reasons if reason and r.startswith(reason)] or (reason is None and not switches.reasons)
