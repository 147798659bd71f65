"""Every environment variable a package's build reads, what it controls, and what each variant sets (pure).

Read, never run: ``setup.py``'s syntax tree (``os.environ[...]``, ``os.environ.get``, ``os.getenv``, ``"X" in
os.environ``, and the same through a module-level helper that takes the name as a parameter, names resolved
through module-level constants), CMake files (``$ENV{X}``, ``option()``, a ``CUDA_ARCHITECTURES`` that comes
from a variable), and ``pyproject.toml``/``setup.cfg`` (scikit-build-core's ``{env = "X"}``). Each variable is
classified by its name and how it is compared (:data:`Role`); :func:`read_switches` turns the relevant ones
into ``build_env`` entries, each with the reason it was written, and lists the rest.

The patterns behind it are common to public kernel packages: a prebuilt-wheel download unless
``<X>_FORCE_BUILD`` (flash-attention's ``bdist_wheel``); CUDA only where a GPU is seen unless ``FORCE_CUDA=1``
(build machines have none); ops compiled only when ``<X>_BUILD_OPS=1``; a CPU build only when
``<X>_CUDA_EXT=0``; a CUDA major version the build requires; the build's own arch variable.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Literal, get_args

from kiln.tasks.onboarding.names import module_constants

Role = Literal["download", "force_cuda", "cuda_toggle", "skip_cuda", "rocm", "build_ops", "archs", "cuda_version",
               "parallelism", "version_suffix", "other"]
ROLES: tuple[str, ...] = get_args(Role)
_DESCRIBE: dict[str, str] = {
    "download": "download vs build", "force_cuda": "forces the CUDA build", "cuda_toggle": "switches the CUDA"
    " build on or off", "skip_cuda": "skips the CUDA build", "rocm": "the ROCm build", "build_ops": "builds the"
    " ops ahead of time", "archs": "the arch list", "cuda_version": "the CUDA version", "parallelism":
    "parallelism", "version_suffix": "a version suffix", "other": "other"}
# First match wins: the order puts the specific names before the general ones.
_ROLE_NAMES: tuple[tuple[Role, re.Pattern[str]], ...] = (
    ("download", re.compile(r"(^|_)FORCE_BUILD$")),
    ("skip_cuda", re.compile(r"SKIP_CUDA|NO_CUDA|DISABLE_CUDA|(^|_)(CPU_ONLY|ONLY_CPU)$")),
    ("rocm", re.compile(r"ROCM|(^|_)(HIP|AMD|CK)(_|$)")),
    ("force_cuda", re.compile(r"(^|_)FORCE_CUDA(_EXTENSION|_BUILD)?$")),
    ("archs", re.compile(r"(^|_)(CUDA_?)?ARCH(S|ITECTURES|_LIST)?$|ARCHITECTURES|ARCH_LIST")),
    ("cuda_version", re.compile(r"CUDA_(MAJOR|MINOR|VERSION|VER)$|^CU_VERSION$")),
    ("cuda_toggle", re.compile(r"_CUDA_EXT(ENSION)?S?$|(^|_)(WITH|USE|ENABLE|BUILD)_CUDA$")),
    ("build_ops", re.compile(r"(^|_)(BUILD|WITH)_(OPS|EXTS?|EXTENSIONS|KERNELS|NATIVE|CUDA_OPS)$")),
    ("parallelism", re.compile(r"MAX_JOBS|_JOBS$|PARALLEL|THREADS$")),
    ("version_suffix", re.compile(r"LOCAL_VERSION|VERSION_SUFFIX|(^|_)BUILD_(VERSION|STRING)$|VERSION_LOCAL")),
)
# What Kiln's build sets itself for every variant (kiln.tasks.build.backend.build_environ): never written again.
KILN_SETS = frozenset({"TORCH_CUDA_ARCH_LIST", "CMAKE_CUDA_ARCHITECTURES", "CUDAARCHS", "PYTORCH_ROCM_ARCH",
                       "HIPARCHS", "MAX_JOBS", "CMAKE_BUILD_PARALLEL_LEVEL", "CUDA_HOME", "NVCC_APPEND_FLAGS"})
_CMAKE_ENV = re.compile(r"\$?ENV\{(\w+)\}")
_CMAKE_OPTION = re.compile(r"\boption\s*\(\s*(\w+)")
# option(NAME "help" OFF): a switch scikit-build-core sets from SKBUILD_CMAKE_DEFINE ("NAME=ON;OTHER=ON")
_CMAKE_OPTION_OFF = re.compile(r"""\boption\s*\(\s*(\w+)\s+(?:"[^"]*"|\S+)\s+OFF\s*\)""", re.I)
_SKBUILD = re.compile(r"""build-backend\s*=\s*["']scikit_build_core""")
SKBUILD_DEFINE = "SKBUILD_CMAKE_DEFINE"
_CMAKE_ARCH_VAR = re.compile(r"CUDA_ARCHITECTURES\s+\"?\$\{(\w+)\}")
_CMAKE_SET_FROM_ENV = re.compile(r"\bset\s*\(\s*(\w+)\s+\"?\$ENV\{(\w+)\}")
# A CMake variable of CUDA_ARCHITECTURES that no $ENV sets: it says how a variable setup.py reads under the same
# name (and passes as -D) is spelled, and is no variable of its own.
_SPELLING_ONLY = "CMake CUDA_ARCHITECTURES (spelling)"
_CONFIG_ENV = re.compile(r"""\benv\s*=\s*["'](\w+)["']""")
_SKIP_CUDA = re.compile(r"""["']([A-Z][A-Z0-9_]*_SKIP_CUDA_BUILD)["']""")
_DOWNLOAD = re.compile(r"\b(CachedWheelsCommand|urlretrieve|urlopen|requests\.get)\b")
_CUDART = re.compile(r"""["']cudart(_static)?["']|-lcudart|CUDA::cudart""")
# An arch variable whose default is no CUDA arch list (ROCm's gfx names, "native"): not the CUDA build's.
_NOT_CUDA_ARCHS = re.compile(r"gfx|native", re.I)
_TRUE = ("1", "TRUE", "ON", "YES")
_OPENS_CUDA = ("cuda_toggle", "force_cuda", "build_ops")


@dataclass(frozen=True)
class EnvRead:
    """One variable the build reads: where, its literal default, the value it is compared with, its role."""

    name: str
    where: str
    default: str | None = None
    compared: str | None = None
    required: bool = False  # setup.py reads os.environ[name]: it raises KeyError unless it is set
    role: Role = "other"


@dataclass(frozen=True)
class Switches:
    cuda_extension: bool  # it builds a CUDAExtension (device code)
    cpu_extension: bool  # it builds a CppExtension: a real CPU path
    gpu_env: tuple[tuple[str, str], ...]  # what its GPU variants' build_env sets
    reasons: tuple[str, ...]
    cpu_env: tuple[tuple[str, str], ...] = ()  # what its CPU variant's build_env sets (the switch opening it)
    reads: tuple[EnvRead, ...] = ()
    also_read: tuple[str, ...] = ()  # "NAME (role, where)" of each variable read and not written
    cudart: bool = False  # it links the CUDA runtime (a GPU build even with no .cu file)
    assumed: tuple[str, ...] = ()  # values kiln init had to assume (the CUDA version it wrote)

    def role(self, role: Role) -> list[EnvRead]:
        return [r for r in self.reads if r.role == role]


def classify(name: str) -> Role:
    return next((role for role, pattern in _ROLE_NAMES if pattern.search(name)), "other")


def _str(node: ast.expr | None, constants: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str | int | bool):
        return str(node.value)
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def _is_environ(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def _env_call(call: ast.Call) -> bool:
    """``os.getenv(...)``, ``getenv(...)``, ``os.environ.get(...)``."""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id == "getenv"
    return isinstance(func, ast.Attribute) and (func.attr == "getenv" or (
        func.attr == "get" and _is_environ(func.value)))


def _helpers(tree: ast.Module) -> dict[str, tuple[int, bool]]:
    """Module-level functions that read the variable their parameter names: name -> (that parameter's index,
    whether it reads ``os.environ[...]``, which raises where the variable is unset)."""
    found: dict[str, tuple[int, bool]] = {}
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        params = [a.arg for a in fn.args.args]
        for node in ast.walk(fn):
            key = (node.args[0] if isinstance(node, ast.Call) and _env_call(node) and node.args else
                   node.slice if isinstance(node, ast.Subscript) and _is_environ(node.value) else None)
            if isinstance(key, ast.Name) and key.id in params:
                found[fn.name] = (params.index(key.id), isinstance(node, ast.Subscript))
    return found


def _unwrap(node: ast.expr) -> ast.expr:
    """``os.getenv("X", "0").lower()``, ``int(os.getenv("X", "0"))`` -> the read itself."""
    while isinstance(node, ast.Call):
        if isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Call):
            node = node.func.value
        elif isinstance(node.func, ast.Name) and node.func.id in ("int", "bool", "str") and node.args:
            node = node.args[0]
        else:
            break
    return node


def _setup_py_reads(tree: ast.Module) -> list[EnvRead]:
    constants, helpers = module_constants(tree), _helpers(tree)
    compared: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and node.comparators:
            value = _str(node.comparators[0], constants)
            if value is None and isinstance(node.comparators[0], ast.Tuple | ast.List | ast.Set):
                value = next((_str(e, constants) for e in node.comparators[0].elts), None)
            if value is not None:
                compared[id(_unwrap(node.left))] = value
    reads: list[EnvRead] = []
    for node in ast.walk(tree):
        name = default = None
        required = False
        if isinstance(node, ast.Call) and _env_call(node) and node.args:
            name = _str(node.args[0], constants)
            default = _str(node.args[1], constants) if len(node.args) > 1 else None
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in helpers:
            index, required = helpers[node.func.id]
            name = _str(node.args[index], constants) if len(node.args) > index else None
            default = _str(node.args[index + 1], constants) if len(node.args) > index + 1 else None
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            name, required = _str(node.slice, constants), True
        elif isinstance(node, ast.Compare) and any(isinstance(o, ast.In | ast.NotIn) for o in node.ops) and (
                _is_environ(node.comparators[0])):
            name = _str(node.left, constants)
        if name and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            reads.append(EnvRead(name, "setup.py", default, compared.get(id(node)), required, classify(name)))
    return reads


def _cmake_reads(cmake: str) -> list[EnvRead]:
    reads = [EnvRead(n, "CMake", role=classify(n)) for n in _CMAKE_ENV.findall(cmake)]
    from_env = dict(_CMAKE_SET_FROM_ENV.findall(cmake))
    for var in _CMAKE_ARCH_VAR.findall(cmake):  # CUDA_ARCHITECTURES ${VAR}: CMake's spelling is VAR's
        where = "CMake CUDA_ARCHITECTURES" if var in from_env else _SPELLING_ONLY  # else a -D, no variable itself
        reads.append(EnvRead(from_env.get(var, var), where, "90-real", role="archs"))
    return reads


def _cmake_options(cmake: str, setup_py: str) -> list[EnvRead]:
    """The CMake ``option()`` switches setup.py passes on (``-DNAME=``): a -D setting, no environment variable, so
    listed and never written (the variable setup.py takes its value from is read, and classified, itself)."""
    return [EnvRead(n, "CMake option() via setup.py", role=classify(n)) for n in _CMAKE_OPTION.findall(cmake)
            if f"-D{n}=" in setup_py]


def _skbuild_defines(cmake: str, config: str) -> tuple[list[str], list[str]]:
    """The CMake options a scikit-build-core project keeps off unless told, that open its CUDA build or its ops:
    (names, reasons). scikit-build-core takes -D settings from ``SKBUILD_CMAKE_DEFINE`` (``NAME=ON``), so these
    are written, where setup.py's -D options are only listed."""
    if not _SKBUILD.search(config):
        return [], []
    names = [n for n in dict.fromkeys(_CMAKE_OPTION_OFF.findall(cmake)) if classify(n) in _OPENS_CUDA]
    return names, [f"build_env {SKBUILD_DEFINE} {n}=ON: the CMake option(), off by default, that compiles its CUDA"
                   " code (scikit-build-core passes it on as -D)" for n in names]


def _merge(reads: list[EnvRead]) -> tuple[EnvRead, ...]:
    """One entry per variable: the first place it is read, with what any other read adds."""
    merged: dict[str, EnvRead] = {}
    for read in sorted(reads, key=lambda r: r.where == _SPELLING_ONLY):
        seen = merged.get(read.name)
        if seen is None and read.where != _SPELLING_ONLY:
            merged[read.name] = read
        elif seen is None:
            continue  # a CMake variable setup.py passes as -D from a variable of another name (or none)
        else:
            cmake_arch = read.where in ("CMake CUDA_ARCHITECTURES", _SPELLING_ONLY)  # CMake's spelling: it parses it
            merged[read.name] = EnvRead(seen.name, seen.where, read.default if cmake_arch else
                                        seen.default or read.default,
                                        seen.compared or read.compared, seen.required or read.required,
                                        "archs" if "archs" in (seen.role, read.role) else seen.role)
    return tuple(merged.values())


def _is_on(value: str | None) -> bool:
    return value is not None and (value.upper() in _TRUE or (value.isdigit() and int(value) > 0))


def _on(read: EnvRead, fallback: str = "1") -> str:
    """The value that switches it on: the one it is compared with where that is a 'true' word (``== "TRUE"``),
    else ``fallback`` (``== "0"`` tests for off: on is the other value)."""
    return read.compared if _is_on(read.compared) and read.compared is not None else fallback


def _off(read: EnvRead) -> str:
    on = _on(read)
    return {"TRUE": "FALSE", "true": "false", "True": "False", "ON": "OFF", "YES": "NO"}.get(on, "0")


def arch_value(archs: tuple[str, ...], default: str | None) -> str:
    """The variant's archs in the spelling of the variable's default: ``"9.0"``, ``"90"``, ``"sm_90"`` or CMake's
    ``"90-real"`` (SASS only, as Kiln's own CMAKE_CUDA_ARCHITECTURES), joined as it joins them (``;`` where the
    default says nothing)."""
    sample = default or ""
    sep = next((s for s in (";", ",", " ") if s in sample.strip()), ";")
    if "." in sample or not sample:
        return sep.join(archs)
    if sample.endswith("-real"):
        return sep.join(a.replace(".", "") + "-real" for a in archs)
    prefix = "sm_" if "sm_" in sample else ""
    return sep.join(prefix + a.replace(".", "") for a in archs)


def read_switches(setup_py: str, tree: ast.Module | None, cmake: str = "", config: str = "",
                  archs: tuple[str, ...] = ("9.0",), cuda: str = "13.0", top_cmake: str = "") -> Switches:
    """The build switches and extension kinds of a package: ``setup_py`` (and ``tree``, its syntax tree, None if
    unparsable), the text of its CMake files and of its pyproject.toml/setup.cfg; ``archs`` and ``cuda``: the GPU
    variant's archs and CUDA version (what its arch and CUDA-version variables are set from); ``top_cmake``: its
    top CMakeLists.txt, whose options are the project's own (a vendored library's are not)."""
    reads = _merge([*(_setup_py_reads(tree) if tree is not None else []), *_cmake_reads(cmake),
                    *_cmake_options(cmake, setup_py),
                    *(EnvRead(n, "pyproject.toml/setup.cfg", role=classify(n)) for n in _CONFIG_ENV.findall(config))])
    used = _used_names(tree)
    gpu: dict[str, str] = {}
    cpu: dict[str, str] = {}
    reasons: list[str] = []
    assumed: list[str] = []
    for read in reads:
        where = read.where
        if read.name in KILN_SETS or read.where.startswith("CMake option()"):
            continue
        if read.role == "download":
            gpu[read.name] = _on(read, "TRUE")
            reasons.append(f"build_env {read.name}={gpu[read.name]}: unless it is set, {where}'s bdist_wheel"
                           " downloads a prebuilt wheel instead of building one")
        elif read.role == "force_cuda":
            gpu[read.name] = _on(read)
            reasons.append(f"build_env {read.name}={gpu[read.name]}: {where} compiles its CUDA code only when it"
                           " sees a GPU or that switch, and build machines have no GPU")
        elif read.role == "cuda_toggle":
            gpu[read.name], cpu[read.name] = _on(read), _off(read)
            reasons.append(f"build_env {read.name}={gpu[read.name]} (GPU) / {cpu[read.name]} (CPU): {where} builds"
                           " its CUDA code or its CPU path by that switch")
        elif read.role == "build_ops" and not _is_on(read.default):  # on by default: nothing to set
            gpu[read.name] = _on(read)
            reasons.append(f"build_env {read.name}={gpu[read.name]}: {where} compiles its ops only when it is set;"
                           " without it the wheel holds no library (its ops compile at run time)")
        elif read.role == "archs" and not _NOT_CUDA_ARCHS.search(read.default or ""):
            gpu[read.name] = arch_value(archs, read.default)
            reasons.append(f"build_env {read.name}={gpu[read.name]!r}: the build takes its CUDA archs from it (the"
                           " variant's archs; Kiln's TORCH_CUDA_ARCH_LIST/CMAKE_CUDA_ARCHITECTURES do not reach it)")
        elif read.role == "cuda_version" and (read.required or not read.name.startswith(("CUDA", "CU_"))):
            # a generic CUDA_VERSION is a container's (NVIDIA's images set it); the package's own one, or one
            # it requires, is the build's
            major = cuda.split(".")[0]
            gpu[read.name] = major if read.name.endswith("MAJOR") else cuda
            must = "requires" if read.required else "reads"
            reasons.append(f"build_env {read.name}={gpu[read.name]}: {where} {must} the CUDA version (the variant's)")
            assumed.append(f"{read.name}={gpu[read.name]}: the CUDA version of kiln init's default GPU variant; set it"
                           " to the toolkit your GPU builders have")
    defines, why = _skbuild_defines(top_cmake, config)
    if defines:
        gpu[SKBUILD_DEFINE] = ";".join(f"{n}=ON" for n in defines)
        reasons += why
    also = tuple(f"{r.name} ({_DESCRIBE[r.role]}, {r.where})" for r in reads
                 if r.name not in gpu and r.name not in cpu and r.name not in KILN_SETS)
    if not gpu and _DOWNLOAD.search(setup_py):
        reasons.append("setup.py may download during the build and names no *_FORCE_BUILD switch: Kiln's build"
                       " reaches no download host, so such a download fails the unit rather than publish it")
    skip = _SKIP_CUDA.search(setup_py)
    if skip is not None:
        reasons.append(f"{skip.group(1)} makes a wheel without its kernels (for sdists): no CPU variant")
    cudart = bool(_CUDART.search(setup_py) or _CUDART.search(cmake))
    return Switches("CUDAExtension" in used, "CppExtension" in used, tuple(gpu.items()), tuple(reasons),
                    tuple(cpu.items()), reads, also, cudart, tuple(assumed))


def _used_names(tree: ast.Module | None) -> set[str]:
    """Names the module uses (an import alone does not count: flash-attention imports CppExtension, unused)."""
    if tree is None:
        return set()
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
