"""Cross-building a wheel for another CPU (aarch64: NVIDIA's Grace machines) on this x86_64 builder.

A ``pep517`` package's extension is compiled by Debian's cross toolchain (``aarch64-linux-gnu-gcc``,
package ``gcc-aarch64-linux-gnu``), driven by the builder's own CPython of the same ``major.minor``, so
the package's build backend runs as it always does. Three things make that CPython build for the target:

- ``_PYTHON_HOST_PLATFORM=linux-aarch64``: the platform sysconfig (so setuptools' ``bdist_wheel`` and
  pip) report; the wheel is tagged ``linux_aarch64``.
- A sysconfig data module for the target (``_PYTHON_SYSCONFIGDATA_NAME``, as CPython's own cross builds and
  crossenv do): the host's build variables with the target's compiler, extension suffix
  (``.cpython-311-aarch64-linux-gnu.so``, the one an aarch64 interpreter imports) and ABI name, and
  none of the host's flags or library folders (they name x86_64 objects).
- The target's headers. CPython 3.11's include folder is the same on every Linux CPU except
  ``pyconfig.h`` (word sizes, ``HAVE_GCC_ASM_FOR_X87``, ``HAVE_USABLE_WCHAR_T``…), so the build gets a
  copy of the host's folder with the target's ``pyconfig.h`` in it, first on the include path. The
  target's comes from Debian's arm64 ``libpython3.X-dev`` package, pinned by URL and sha256 in
  ``cross_pins.json`` and cached: the smallest real aarch64 CPython configuration to be had without an
  aarch64 machine (a debootstrap'd userland has the same file, at minutes instead of one download). A copy
  is needed because ``Python.h`` includes ``"pyconfig.h"`` in quotes, which finds the file beside it
  before any ``-I`` folder.

The ``linux_aarch64`` wheel is then tagged ``manylinux_*_aarch64`` by auditwheel's analysis (it reads the
wheel's ELF machine, so it judges an aarch64 wheel on this x86_64 host) and ``wheel tags``; like every
Kiln wheel, nothing is grafted (``auditwheel repair`` would also need patchelf). What this proves about the wheel
on a real aarch64 machine is in docs/guides/matrix.md: it is compiled and tagged here, and run under qemu by
the opt-in emulation test; only a Grace machine runs its GPU code.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import lzma
import os
import platform
import shutil
import sys
import sysconfig
import tarfile
import tempfile
import tomllib
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kiln.core.errors import CompileError, ConfigError, IntegrityError, InvalidInputError
from kiln.core.fsutil import atomic_write_bytes
from kiln.tasks.process import run_tool
from kiln.tasks.project.config import Backend, KilnConfig, Variant
from kiln.tasks.project.config_matrix import built_for, cell_python
from kiln.tasks.project.config_project import pinned_version
from kiln.tasks.wheel.manylinux import EXCLUDES

_log = logging.getLogger(__name__)

PINS = Path(__file__).with_name("cross_pins.json")
DOWNLOAD_TIMEOUT_S = 120
AUDITWHEEL_TIMEOUT_S = 300
_MODULE = "_sysconfigdata_kiln_cross"


@dataclass(frozen=True)
class CrossTarget:
    """A CPU a wheel can be cross-built for: its GNU triple names the toolchain and the extension suffix."""

    platform: str  # kiln.toml's name: "aarch64"
    triple: str  # "aarch64-linux-gnu"

    @property
    def host_platform(self) -> str:
        return f"linux-{self.platform}"

    @property
    def wheel_platform(self) -> str:
        return f"linux_{self.platform}"

    def tool(self, name: str) -> str:
        return f"{self.triple}-{name}"


TARGETS: dict[str, CrossTarget] = {"aarch64": CrossTarget("aarch64", "aarch64-linux-gnu")}


def target(platform: str) -> CrossTarget:
    try:
        return TARGETS[platform]
    except KeyError:
        raise InvalidInputError(f"no cross target {platform!r}: Kiln cross-builds for {sorted(TARGETS)}") from None


def compiler(cross: CrossTarget) -> str | None:
    """The cross C compiler on PATH (Debian's ``gcc-aarch64-linux-gnu``), or None."""
    return shutil.which(cross.tool("gcc"))


def default_cache_dir() -> Path:
    """Where the target's pinned header package and staged include folder are kept between builds."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kiln" / "cross"


def _python(version: str | None = None) -> str:
    return version or f"{sys.version_info.major}.{sys.version_info.minor}"


def header_pin(cross: CrossTarget, python: str, pins: Path = PINS) -> dict[str, str]:
    """The pinned package holding the target's ``pyconfig.h`` for CPython ``python`` (``"3.11"``)."""
    data = json.loads(pins.read_text())
    if data.get("schema_version") != 1:
        raise InvalidInputError(f"{pins}: schema_version {data.get('schema_version')!r}, expected 1")
    pin = data.get("headers", {}).get(cross.platform, {}).get(python)
    if not isinstance(pin, dict) or set(pin) != {"url", "sha256", "member"}:
        raise InvalidInputError(f"{pins}: no pinned {cross.platform} headers for CPython {python} (headers."
                                f"{cross.platform}.\"{python}\" with url, sha256, member); add Debian's"
                                f" libpython{python}-dev for that CPU")
    return {k: str(v) for k, v in pin.items()}


def _deb_member(deb: bytes, member: str) -> bytes:
    """One file of a Debian package (an ``ar`` archive whose ``data.tar.xz`` holds the files)."""
    if not deb.startswith(b"!<arch>\n"):
        raise IntegrityError("not a Debian package: no ar header")
    offset = 8
    while offset + 60 <= len(deb):
        name, size = deb[offset:offset + 16].decode().strip().rstrip("/"), int(deb[offset + 48:offset + 58])
        body = deb[offset + 60:offset + 60 + size]
        if name.startswith("data.tar"):
            raw = lzma.decompress(body) if name.endswith(".xz") else body
            with tarfile.open(fileobj=io.BytesIO(raw)) as archive:
                found = archive.extractfile(f"./{member}")
                if found is None:
                    raise IntegrityError(f"the package holds no file {member}")
                return found.read()
        offset += 60 + size + (size % 2)
    raise IntegrityError("the package has no data.tar member")


def _download(url: str) -> bytes:
    _log.info("downloading %s", url)
    with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
        return bytes(response.read())


def target_pyconfig(cross: CrossTarget, python: str, cache_dir: Path,
                    fetch: Callable[[str], bytes] = _download) -> bytes:
    """The target's ``pyconfig.h``: from its pinned package, downloaded once into ``cache_dir`` and checked."""
    pin = header_pin(cross, python)
    cached = cache_dir / f"{pin['sha256']}.deb"
    deb = cached.read_bytes() if cached.is_file() else fetch(pin["url"])
    got = hashlib.sha256(deb).hexdigest()
    if got != pin["sha256"]:
        raise IntegrityError(f"{pin['url']}: sha256 {got}, but cross_pins.json pins {pin['sha256']}; refusing it")
    if not cached.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(cached, deb)
    return _deb_member(deb, pin["member"])


def staged_include(cross: CrossTarget, cache_dir: Path, fetch: Callable[[str], bytes] = _download) -> Path:
    """A copy of this CPython's include folder with the target's ``pyconfig.h`` (see the module docstring);
    made once per target and CPython in ``cache_dir``, renamed into place whole."""
    host = Path(sysconfig.get_paths()["include"])
    python = _python()
    final = cache_dir / f"include-{cross.platform}-{sys.version.split()[0]}" / host.name
    if (final / "pyconfig.h").is_file():
        return final
    pyconfig = target_pyconfig(cross, python, cache_dir, fetch)
    final.parent.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent.parent, prefix=".staging-") as tmp:
        staged = Path(tmp) / host.name
        shutil.copytree(host, staged)
        (staged / "pyconfig.h").write_bytes(pyconfig)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide it from a build run as another user
        try:
            os.replace(tmp, final.parent)
            os.mkdir(tmp)  # for TemporaryDirectory's cleanup
        except OSError:  # another build put it there first: theirs is the same copy
            if not (final / "pyconfig.h").is_file():
                raise
    return final


def sysconfig_data(cross: CrossTarget) -> dict[str, object]:
    """The host's build variables with the target's toolchain, suffix and ABI name (see the module docstring)."""
    host: dict[str, object] = {k: v for k, v in sysconfig.get_config_vars().items() if isinstance(v, (str, int))}
    version = sysconfig.get_config_var("py_version_nodot")
    soabi = f"cpython-{version}-{cross.triple}"
    cc, cxx = cross.tool("gcc"), cross.tool("g++")
    return host | {
        "CC": f"{cc} -pthread", "CXX": f"{cxx} -pthread", "LDSHARED": f"{cc} -pthread -shared",
        "LDCXXSHARED": f"{cxx} -pthread -shared", "BLDSHARED": f"{cc} -pthread -shared", "AR": cross.tool("ar"),
        "CFLAGS": "-DNDEBUG -g -fwrapv -O2 -Wall", "CCSHARED": "-fPIC", "LDFLAGS": "", "CPPFLAGS": "",
        "OPT": "-DNDEBUG -g -fwrapv -O2 -Wall", "SOABI": soabi, "EXT_SUFFIX": f".{soabi}.so",
        "MULTIARCH": cross.triple, "HOST_GNU_TYPE": cross.triple, "MACHDEP": "linux",
        # the target interpreter's extensions do not link libpython (Debian's is static, manylinux forbids it)
        "Py_ENABLE_SHARED": 0, "LIBDIR": "", "LIBPL": "",
    }


def write_sysconfig(cross: CrossTarget, folder: Path) -> str:
    """Write the target's sysconfig data module into ``folder``; its module name."""
    name = f"{_MODULE}_{cross.platform}"
    folder.mkdir(parents=True, exist_ok=True)
    text = f"# the {cross.platform} target's build variables (kiln.tasks.build.cross)\n" \
           f"build_time_vars = {sysconfig_data(cross)!r}\n"
    atomic_write_bytes(folder / f"{name}.py", text.encode(), durable=False)
    return name


def cross_environ(cross: CrossTarget, include: Path, sysconfig_dir: Path, module: str,
                  base: Mapping[str, str]) -> dict[str, str]:
    """``base`` with the variables that make this CPython's build backend build for ``cross``."""
    cc, cxx = cross.tool("gcc"), cross.tool("g++")
    path = os.pathsep.join(filter(None, [str(sysconfig_dir), base.get("PYTHONPATH", "")]))
    return dict(base) | {
        "_PYTHON_HOST_PLATFORM": cross.host_platform, "_PYTHON_SYSCONFIGDATA_NAME": module, "PYTHONPATH": path,
        "CC": cc, "CXX": cxx, "LDSHARED": f"{cc} -shared", "LDCXXSHARED": f"{cxx} -shared", "AR": cross.tool("ar"),
        # first on the include path, before the host's own folder that setuptools adds; the build's own flags
        # (the reproducible build's path maps) kept after it
        **{flags: " ".join(filter(None, [f"-I{include}", base.get(flags, "")]))
           for flags in ("CFLAGS", "CXXFLAGS", "CPPFLAGS")},
    }


def cross_build(project_dir: Path, out_dir: Path, cross: CrossTarget, cache_dir: Path, timeout_s: float,
                base: Mapping[str, str] | None = None, python: str = sys.executable) -> Path:
    """Build ``project_dir``'s wheel for ``cross`` with ``python``'s pip (no isolation, no dependencies): the
    ``linux_<cpu>`` wheel in ``out_dir``."""
    what = f"the {cross.platform} build of {project_dir}"
    if compiler(cross) is None:
        raise CompileError(f"{what}: no {cross.tool('gcc')} on PATH; install Debian's gcc-{cross.triple}"
                           f" (and g++-{cross.triple} for C++)")
    include = staged_include(cross, cache_dir)
    with tempfile.TemporaryDirectory(prefix="kiln-cross-") as tmp:
        module = write_sysconfig(cross, Path(tmp) / "sysconfig")
        environ = cross_environ(cross, include, Path(tmp) / "sysconfig", module,
                                base if base is not None else os.environ)
        dist = Path(tmp) / "dist"
        cmd = [python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(dist),
               str(project_dir)]
        result = run_tool(cmd, timeout_s, cwd=project_dir, env=environ)
        if result.returncode != 0:
            raise CompileError(f"{what} failed (exit {result.returncode}); its log ends:\n{result.stdout[-4000:]}")
        wheels = sorted(dist.glob(f"*-{cross.wheel_platform}.whl"))
        if len(wheels) != 1:
            raise CompileError(f"{what} left {sorted(p.name for p in dist.glob('*.whl'))}, expected one"
                               f" {cross.wheel_platform} wheel")
        out_dir.mkdir(parents=True, exist_ok=True)
        return Path(shutil.move(wheels[0], out_dir / wheels[0].name))


def _glibc(policy: str) -> tuple[int, int]:
    """``manylinux_2_28_aarch64`` -> (2, 28)."""
    major, minor = policy.split("_")[1:3]
    return int(major), int(minor)


def audited_policy(wheel: Path, cross: CrossTarget, backend: Backend = "cpu", target_glibc: str | None = None,
                   timeout_s: float = AUDITWHEEL_TIMEOUT_S) -> str:
    """The ``manylinux_*_<cpu>`` policy ``wheel``'s binaries allow, by auditwheel's analysis (what ``auditwheel
    show`` reports; it reads the ELF machine from the wheel, so an aarch64 wheel is judged as one here), run in
    a child as :mod:`kiln.tasks.wheel.manylinux` runs it; with ``target_glibc`` (``"2_28"``), that target's
    policy, or a :class:`CompileError` naming what needs a newer one."""
    with tempfile.TemporaryDirectory(prefix="kiln-auditwheel-") as tmp:
        report_file = Path(tmp) / "report.json"
        # libc named: an extension that calls only the C-API links no libc for auditwheel to read it from
        cmd = [sys.executable, "-P", "-m", "kiln.tasks.wheel.manylinux", str(wheel), str(report_file), "glibc",
               *EXCLUDES[backend]]
        result = run_tool(cmd, timeout_s)
        if result.returncode != 0 or not report_file.is_file():
            raise CompileError(f"auditwheel could not analyse {wheel.name} (exit {result.returncode}):\n"
                               f"{result.stdout[-2000:]}")
        report = json.loads(report_file.read_text())
    overall = str(report.get("overall", ""))
    if report.get("error") or not overall.startswith("manylinux_") or not overall.endswith(f"_{cross.platform}"):
        raise CompileError(f"{wheel.name} gets no manylinux {cross.platform} tag: auditwheel reports"
                           f" {report.get('error') or overall} (libraries {report.get('libs')}, symbol versions"
                           f" {report.get('symbols')})")
    if target_glibc is None:
        return overall
    wanted = f"manylinux_{target_glibc}_{cross.platform}"
    if _glibc(overall) > _glibc(wanted):
        raise CompileError(f"{wheel.name} does not meet the manylinux target {target_glibc} (kiln.toml [build]"
                           f" manylinux): its binaries need {overall}, symbol versions {report.get('symbols')}")
    return wanted


def manylinux_tagged(wheel: Path, out_dir: Path, cross: CrossTarget, backend: Backend = "cpu",
                     target_glibc: str | None = None, timeout_s: float = AUDITWHEEL_TIMEOUT_S) -> Path:
    """``wheel`` retagged for the policy :func:`audited_policy` names, in ``out_dir``. Only the tag changes
    (``wheel tags`` rewrites the WHEEL file and RECORD): Kiln grafts no library, as for x86_64 wheels."""
    policy = audited_policy(wheel, cross, backend, target_glibc, timeout_s)
    with tempfile.TemporaryDirectory(prefix="kiln-retag-") as tmp:
        copy = Path(shutil.copy2(wheel, Path(tmp) / wheel.name))
        result = run_tool([sys.executable, "-m", "wheel", "tags", "--remove", "--platform-tag", policy, str(copy)],
                          timeout_s, cwd=Path(tmp))
        tagged = sorted(Path(tmp).glob(f"*-{policy}.whl"))
        if result.returncode != 0 or len(tagged) != 1:
            raise CompileError(f"could not retag {wheel.name} {policy} (exit {result.returncode}):\n"
                               f"{result.stdout[-2000:]}")
        out_dir.mkdir(parents=True, exist_ok=True)
        return Path(shutil.move(tagged[0], out_dir / tagged[0].name))


# What the cross path is in a build: which cells take it, which it refuses (before anything builds), and what it
# changes of a pep517 unit's build (kiln.tasks.build.backend runs the unit, in its sandbox, as for any variant).

def _kiln_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def cross_target_of(variant: Variant, machine: str | None = None) -> CrossTarget | None:
    """The target ``variant``'s wheel is cross-built for on this ``machine`` (default: this one); None: built
    natively. A variant of several CPUs has been refused by :func:`check_cross_cells` before it gets here."""
    machine = machine or platform.machine()
    cpus = built_for(variant, machine)
    foreign = [p for p in cpus if p != machine]
    return target(foreign[0]) if len(cpus) == 1 and foreign else None


def _torch_requirement(config: KilnConfig, variant: Variant) -> str:
    """Where the variant's build asks for torch (its ``build_requires``, the project's ``[build-system]``), or ""."""
    pyproject = config.path(config.build.project_dir) / "pyproject.toml"
    data = tomllib.loads(pyproject.read_text()) if pyproject.is_file() else {}
    for where, requirements in (("its build_requires", variant.build_requires),
                                ("the project's [build-system] requires",
                                 data.get("build-system", {}).get("requires", []))):
        if any(canonicalize_name(Requirement(r).name) == "torch" for r in requirements):
            return where
    return ""


def cross_refusal(config: KilnConfig, variant: Variant, machine: str | None = None) -> str:
    """Why the cross path cannot build ``variant``'s wheel here, or "" (it can, or it needs no cross build)."""
    machine = machine or platform.machine()
    cpus = built_for(variant, machine)
    foreign = [p for p in cpus if p != machine]
    if not foreign:
        return ""
    wanted, cpu = f"platform = {list(cpus)}", foreign[0]
    if machine != "x86_64" or cpu not in TARGETS:
        return f"{wanted}: Kiln cross-builds on an x86_64 builder for {sorted(TARGETS)}; this builder is {machine}"
    if config.build.backend != "pep517":
        return (f"{wanted}: Kiln's own wheel builder (the registry's Triton and nvcc units) builds for this {machine}"
                f" builder only; an {cpu} cell is cross-built by the project's own backend ([build] backend ="
                f" \"pep517\", a C/C++ extension) with Debian's {cpu} cross toolchain")
    if variant.backend != "cpu":
        return (f"{wanted}: a {variant.backend} variant's host code needs its toolkit's {cpu} cross target, which"
                f" Kiln does not drive; an {cpu} cell is a cpu variant (a plain C/C++ extension)")
    where = _torch_requirement(config, variant)
    if where and not (where == "its build_requires" and pinned_version(variant.build_requires)):
        return (f"{wanted}: a torch extension ({where} name torch) compiles against its {cpu} torch's headers and"
                f" links its libraries, which the cross build fetches for the one version the variant pins: pin"
                f" torch exactly in the variant's build_requires (torch==X.Y.Z, the torch of this builder's build)")
    python = cell_python(variant)
    if python != _kiln_python():
        return (f"{wanted}: the {cpu} cross build drives Kiln's own CPython {_kiln_python()} with the target's build"
                f" variables, so an {cpu} cell is for Python {_kiln_python()}; this one is for Python {python}:"
                f" exclude it (exclude = [{{python = \"{python}\", platform = \"{cpu}\"}}])")
    try:
        header_pin(target(cpu), python)
    except InvalidInputError as exc:
        return f"{wanted}: {exc}"
    return ""


def check_cross_cells(config: KilnConfig, variants: Sequence[str] | None = None,
                      machine: str | None = None) -> None:
    """Refuse, before anything builds, every chosen variant whose CPU the cross path cannot serve here
    (:func:`cross_refusal`): never an x86_64 wheel in place of the aarch64 one it asked for."""
    chosen = [config.variant(name) for name in variants] if variants else list(config.variants)
    refused = [f"variant {v.name!r}: {why}" for v in chosen if (why := cross_refusal(config, v, machine))]
    if refused:
        raise ConfigError("the build is refused before anything builds:\n  - " + "\n  - ".join(refused))


def unit_environ(cross: CrossTarget, environ: Mapping[str, str], folder: Path,
                 cache_dir: Path | None = None) -> tuple[dict[str, str], list[Path]]:
    """(``environ`` that makes a build backend build for ``cross``, the folders its sandbox must read): the
    target's sysconfig module written into ``folder`` (the unit's own), its staged include folder."""
    include = staged_include(cross, cache_dir or default_cache_dir())
    module = write_sysconfig(cross, folder)
    # the staged headers live under this worker's home; their path in the debug info must not make two workers'
    # wheels differ (invariant 8), as the unit's own folder is mapped by the reproducible build
    mapped = f"-ffile-prefix-map={include.parent}=/kiln/cross-include"
    flags = {name: " ".join(filter(None, [environ.get(name, ""), mapped])) for name in ("CFLAGS", "CXXFLAGS")}
    return cross_environ(cross, include, folder, module, {**environ, **flags}), [include]


def checked_wheel(wheel: Path, cross: CrossTarget) -> Path:
    """``wheel`` when the backend built it for ``cross`` (``*-linux_aarch64.whl``); a :class:`CompileError` else
    (a build that ignored the target's variables made a wheel for this builder)."""
    if not wheel.name.endswith(f"-{cross.wheel_platform}.whl"):
        raise CompileError(f"the {cross.platform} build made {wheel.name}, not a {cross.wheel_platform} wheel: its"
                           f" backend did not build with the target's sysconfig ({cross.tool('gcc')})")
    return wheel
