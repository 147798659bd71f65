"""The carry of the offline GPU check: prepared here, installed on a bare GPU machine with no index.

A GPU machine is lent rarely, for minutes, and reaches no package index. It
has torch, Triton, their CUDA libraries and numpy; it lacks Prefect, pydantic,
uv and Kiln's own three distributions. ``prepare`` writes, under one folder
of at most ``limit_mib`` (``benchmarks/gpu_carry.toml``), the wheels of
everything the check needs beyond what the machine provides, for the
machine's Python and platform, plus Kiln's wheels, and a ``carry.json``
naming the target; a target it cannot serve is refused, naming the
distribution. ``benchmarks/gpu_check.sh`` then, on the machine:

- ``layer``: (run by the machine's own Python) links the closure of the
  provided distributions (torch, Triton, numpy and what they need) into one
  folder, the path layer a fresh venv sees after its own site-packages;
- ``check``: (run by the venv's Python, after the install) refuses a machine
  whose Python, torch or Triton is not the carry's target, and names any
  module the check needs that cannot be imported;
- ``seed-base``: gives the bench stage the base environment it would
  otherwise make with pip from an index (:mod:`kiln.tasks.testing.baseenv`):
  the same distributions, linked from the venv and its layer, under the
  key and marker :func:`kiln.tasks.build.buildenv.ensure_env` looks for.

``python benchmarks/gpu_carry.py prepare --python-version 3.12 --torch-version 2.11.0
--triton-version 3.6.0 --out .gpu-carry``
"""

from __future__ import annotations

import argparse
import email.message
import email.parser
import importlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

log = logging.getLogger("kiln.benchmarks.gpu_carry")

SPEC = Path(__file__).with_name("gpu_carry.toml")
ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "carry.json"
PROJECTS = (".", "runtime", "kernels")  # kiln, kiln-runtime, kiln-kernels
SPEC_KEYS = frozenset({"needs", "provided", "omitted", "platforms", "limit_mib"})
PIP_TIMEOUT_S = 600.0
BUILD_TIMEOUT_S = 300.0
MIB = 1024 * 1024
# Modules the check imports in the venv: one missing is named before any step runs.
CHECK_IMPORTS = ("kiln.flows.cli", "kiln.flows.bench", "prefect.server.api.server", "kiln_kernels", "pytest",
                 "pytest_timeout", "pydantic", "torch", "triton", "numpy", "setuptools", "wheel", "cyclonedx")


class CarryError(Exception):
    """The carry cannot be prepared or used; the message says what and what to do."""

    exit_status = 2


class TargetRefusedError(CarryError):
    """The target (Python, platform, torch, Triton) is one this carry cannot serve."""


class CarryTooLargeError(CarryError):
    """The carry is over its size limit."""


class MachineMismatchError(CarryError):
    """The machine is not the carry's target, or lacks what the check needs."""


@dataclass(frozen=True)
class Target:
    python_version: str
    torch_version: str
    triton_version: str
    platforms: tuple[str, ...]

    @property
    def python(self) -> tuple[int, int]:
        major, _, minor = self.python_version.partition(".")
        return int(major), int(minor)

    def tags(self) -> frozenset[Tag]:
        """Every wheel tag an installer on the target accepts."""
        return frozenset([*cpython_tags(self.python, platforms=self.platforms),
                          *compatible_tags(self.python, platforms=self.platforms)])

    def marker_environment(self) -> dict[str, str]:
        return {"python_version": self.python_version, "python_full_version": f"{self.python_version}.0",
                "platform_system": "Linux", "sys_platform": "linux", "platform_machine": "x86_64",
                "implementation_name": "cpython", "platform_python_implementation": "CPython",
                "os_name": "posix", "extra": ""}


@dataclass(frozen=True)
class CarrySpec:
    needs: tuple[str, ...]
    provided: tuple[str, ...]
    omitted: tuple[str, ...]
    platforms: tuple[str, ...]
    limit_mib: float


def load_spec(path: Path = SPEC) -> CarrySpec:
    """``gpu_carry.toml``, parsed once; an unknown or missing key is an error naming it."""
    data = tomllib.loads(path.read_text())
    unknown = sorted(set(data) - SPEC_KEYS)
    missing = sorted(SPEC_KEYS - set(data))
    if unknown or missing:
        raise CarryError(f"{path}: unknown keys {unknown}, missing keys {missing}; expected {sorted(SPEC_KEYS)}")
    return CarrySpec(tuple(data["needs"]), tuple(data["provided"]), tuple(data["omitted"]),
                     tuple(data["platforms"]), float(data["limit_mib"]))


def parse_python_version(text: str) -> str:
    if not re.fullmatch(r"3\.\d{1,2}", text):
        raise CarryError(f"--python-version {text!r} is not MAJOR.MINOR (e.g. 3.12)")
    return text


def parse_version(text: str, what: str) -> str:
    try:
        return str(Version(text))
    except ValueError as exc:
        raise CarryError(f"{what} {text!r} is not a version (e.g. 2.11.0)") from exc


# --- prepare (here, with an index) -------------------------------------------------------------


def _run(cmd: Sequence[str], what: str, timeout_s: float,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    log.info("running %s", " ".join(cmd))
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout_s, check=False, env=env)
    except subprocess.TimeoutExpired as exc:
        raise CarryError(f"{what} did not finish within {timeout_s:g}s") from exc


def _wheel_metadata(wheel: Path) -> email.message.Message:
    from kiln.core.wheels import core_metadata  # the one bounded METADATA reader

    return email.parser.BytesHeaderParser().parsebytes(core_metadata(wheel.name, wheel))


def needed_names(spec: CarrySpec, project: Sequence[Path], target: Target) -> list[str]:
    """What Kiln's wheels declare for the target, and the check's own ``needs``, less what is not carried."""
    ours = {canonicalize_name(_wheel_metadata(w)["Name"]) for w in project}
    left_out = ours | {canonicalize_name(n) for n in (*spec.provided, *spec.omitted)}
    names = [canonicalize_name(n) for n in spec.needs]
    for wheel in project:
        for text in _wheel_metadata(wheel).get_all("Requires-Dist") or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(target.marker_environment()):
                names.append(canonicalize_name(req.name))
    return sorted(set(names) - left_out)


def pinned(names: Sequence[str]) -> list[str]:
    """``name==version`` of each, at the version this interpreter has (what Kiln is tested with)."""
    pins = []
    for name in names:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError as exc:
            raise CarryError(f"{name} (a dependency of Kiln's wheels or a `needs` of benchmarks/gpu_carry.toml) "
                             f"is not installed in {sys.executable}; prepare the carry from Kiln's dev environment"
                             ) from exc
    return pins


def build_project_wheels(dest: Path, root: Path = ROOT) -> list[Path]:
    """Kiln's three wheels, built from this checkout (setuptools' build and egg-info folders kept out of it)."""
    dest.mkdir(parents=True, exist_ok=True)
    scratch = dest / "setuptools"
    config = dest / "setuptools.cfg"
    config.write_text(f"[build]\nbuild_base = {scratch / 'build'}\n[egg_info]\negg_base = {scratch}\n")
    (scratch / "build").mkdir(parents=True)
    done = _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(dest),
                 *(str(root / p) for p in PROJECTS)], "building Kiln's wheels", BUILD_TIMEOUT_S,
                env={**os.environ, "DIST_EXTRA_CONFIG": str(config)})
    if done.returncode != 0:
        raise CarryError(f"building Kiln's wheels failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}")
    return sorted(dest.glob("*.whl"))


def check_project_wheel(wheel: Path, target: Target) -> None:
    """Refuse a target whose Python, torch or Triton the wheel does not accept, naming the wheel."""
    meta = _wheel_metadata(wheel)
    name = meta["Name"]
    requires_python = SpecifierSet(meta.get("Requires-Python") or "")
    if not requires_python.contains(f"{target.python_version}.0"):
        raise TargetRefusedError(f"the target cannot be served: {name} requires Python {requires_python}, "
                                 f"the target is Python {target.python_version}")
    env = target.marker_environment()
    versions = {"torch": target.torch_version, "triton": target.triton_version}
    for text in meta.get_all("Requires-Dist") or []:
        req = Requirement(text)
        have = versions.get(canonicalize_name(req.name))
        if have is None or (req.marker is not None and not req.marker.evaluate(env)):
            continue
        if not req.specifier.contains(have, prereleases=True):
            raise TargetRefusedError(f"the target cannot be served: {name} requires {req}, "
                                     f"the target has {req.name} {have}")


def _pip_target_options(target: Target) -> list[str]:
    options = ["--only-binary", ":all:", "--python-version", target.python_version, "--implementation", "cp"]
    return options + [o for p in target.platforms for o in ("--platform", p)]


_NO_WHEEL = re.compile(r"No matching distribution found for (\S+)")


def _refusal(stderr: str, target: Target) -> CarryError:
    found = _NO_WHEEL.findall(stderr)
    if found:
        name = Requirement(found[-1]).name
        return TargetRefusedError(
            f"the target cannot be served: {name} ({found[-1]}) has no wheel for Python {target.python_version} "
            f"on {target.platforms[0]} (or any platform listed in benchmarks/gpu_carry.toml)")
    return CarryError(f"pip could not resolve the carry: {stderr.strip()[-1500:]}")


def resolve(pins: Sequence[str], target: Target, work: Path) -> list[tuple[str, str]]:
    """(name, version) of the closure of ``pins`` on the target, by pip's resolver (wheels only)."""
    report = work / "report.json"
    done = _run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                 "--report", str(report), "--target", str(work / "target"), *_pip_target_options(target), *pins],
                "resolving the carry", PIP_TIMEOUT_S)
    if done.returncode != 0:
        raise _refusal(done.stderr, target)
    installs = json.loads(report.read_text())["install"]
    return [(canonicalize_name(i["metadata"]["name"]), i["metadata"]["version"]) for i in installs]


def download(resolved: Iterable[tuple[str, str]], target: Target, dest: Path) -> None:
    pins = [f"{name}=={version}" for name, version in resolved]
    done = _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(dest),
                 *_pip_target_options(target), *pins], "downloading the carry", PIP_TIMEOUT_S)
    if done.returncode != 0:
        raise _refusal(done.stderr, target)


def carry_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def check_size(folder: Path, limit_mib: float) -> int:
    """The folder's size in bytes; over ``limit_mib`` it is refused, naming its largest files."""
    size = carry_size(folder)
    if size > limit_mib * MIB:
        largest = sorted((p for p in folder.rglob("*") if p.is_file()), key=lambda p: -p.stat().st_size)[:5]
        named = ", ".join(f"{p.name} ({p.stat().st_size / MIB:.1f} MiB)" for p in largest)
        raise CarryTooLargeError(f"the carry {folder} is {size / MIB:.1f} MiB, over its {limit_mib:g} MiB limit; "
                                 f"largest: {named}")
    return size


def wheel_tags(wheel: Path) -> frozenset[Tag]:
    return parse_wheel_filename(wheel.name)[3]


def prepare(target: Target, out: Path, spec: CarrySpec) -> dict[str, Any]:
    """Write the carry for ``target`` into ``out`` (replaced whole); its manifest, with its size in bytes."""
    with tempfile.TemporaryDirectory(prefix="kiln-carry-") as tmp:
        work = Path(tmp)
        project = build_project_wheels(work / "project")
        for wheel in project:
            check_project_wheel(wheel, target)
        left_out = {canonicalize_name(n) for n in (*spec.provided, *spec.omitted)}
        pins = pinned(needed_names(spec, project, target))
        resolved = [(n, v) for n, v in resolve(pins, target, work) if n not in left_out]
        staged = work / "carry"
        download(resolved, target, staged)
        for wheel in project:
            shutil.copy2(wheel, staged / wheel.name)
        _check_served(staged, target)
        manifest: dict[str, Any] = {"target": asdict(target), "provided": list(spec.provided),
                                    "omitted": list(spec.omitted),
                                    "wheels": sorted(p.name for p in staged.glob("*.whl"))}
        (staged / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        manifest["bytes"] = check_size(staged, spec.limit_mib)
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(staged, out)
    return manifest


def _check_served(folder: Path, target: Target) -> None:
    accepted = target.tags()
    for wheel in sorted(folder.glob("*.whl")):
        if not wheel_tags(wheel) & accepted:
            raise TargetRefusedError(f"the target cannot be served: {wheel.name} does not install on Python "
                                     f"{target.python_version} {target.platforms[0]}")


# --- on the machine ---------------------------------------------------------------------------


def _installed() -> dict[str, metadata.Distribution]:
    found: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions():  # in sys.path order: the first one found is the one imported
        found.setdefault(canonicalize_name(dist.metadata["Name"]), dist)
    return found


def closure(roots: Iterable[str]) -> list[metadata.Distribution]:
    """The installed distributions ``roots`` need, with theirs (markers evaluated here); a missing one is named.

    A requirement's extras count (torch's CUDA libraries come as ``cuda-toolkit[cublas,…]``).
    """
    installed = _installed()
    todo = [(canonicalize_name(r), frozenset[str](), "the check") for r in roots]
    seen: dict[str, metadata.Distribution] = {}
    extras_seen: dict[str, frozenset[str]] = {}
    while todo:
        name, extras, wanted_by = todo.pop()
        if name in seen and extras <= extras_seen[name]:
            continue
        dist = installed.get(name)
        if dist is None:
            raise MachineMismatchError(f"{name} (needed by {wanted_by}) is not installed for {sys.executable}")
        seen[name] = dist
        extras_seen[name] = extras_seen.get(name, frozenset()) | extras
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *extras_seen[name])):
                todo.append((canonicalize_name(req.name), frozenset(req.extras), name))
    return list(seen.values())


def link_layer(roots: Iterable[str], dest: Path) -> list[str]:
    """Link every top-level entry of the closure of ``roots`` into ``dest``; the names linked."""
    dest.mkdir(parents=True, exist_ok=True)
    linked: list[str] = []
    for dist in closure(roots):
        if dist.files is None:
            raise MachineMismatchError(f"{dist.metadata['Name']} has no RECORD, so its files cannot be layered")
        for top in sorted({f.parts[0] for f in dist.files if f.parts[0] != ".."}):
            source, link = Path(str(dist.locate_file(top))), dest / top
            if link.is_symlink() or not source.exists():
                continue  # a namespace folder (nvidia/) shared by several distributions: linked once
            link.symlink_to(source, target_is_directory=source.is_dir())
            linked.append(top)
    return linked


def check_machine(manifest: dict[str, object], imports: Sequence[str] = CHECK_IMPORTS) -> None:
    """Refuse a machine that is not the carry's target; name every module the check needs and cannot import."""
    target = manifest["target"]
    assert isinstance(target, dict)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    wrong = [f"Python {here} (the carry is for {target['python_version']})"] if here != target["python_version"] else []
    for name in ("torch", "triton"):
        try:
            have = Version(metadata.version(name)).public
        except metadata.PackageNotFoundError:
            have = "none"
        if have != Version(target[f"{name}_version"]).public:
            wrong.append(f"{name} {have} (the carry is for {target[f'{name}_version']})")
    missing = []
    for module in imports:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{module} ({type(exc).__name__}: {exc})")
    problems = ([f"this machine is not the carry's target: {'; '.join(wrong)}"] if wrong else []) + (
        [f"cannot import (add its distribution to benchmarks/gpu_carry.toml `needs`): {'; '.join(missing)}"]
        if missing else [])
    if problems:
        raise MachineMismatchError(". ".join(problems))


def seed_base() -> Path:
    """The bench stage's base environment, made from what this venv sees instead of by pip from an index.

    :func:`kiln.tasks.testing.baseenv.base_env` runs as in production (its key, location, lock and checks)
    with one step replaced: the environment :func:`kiln.tasks.build.buildenv.ensure_env` would fill with pip
    gets links to the base distributions this venv and its machine layer hold (torch, Triton, numpy from the
    machine; pytest and pydantic from the carry), the same versions :func:`base_pins` asks for.
    """
    from kiln.tasks.build import buildenv
    from kiln.tasks.testing import baseenv

    def linked(tmp: Path, final: Path, requirements: Sequence[str], variant: str, timeout_s: float,
               base: object = None, fill: object = None) -> None:
        # base (a matrix cell's interpreter) and fill (a copy from Kiln's interpreter) are production's ways to
        # fill the environment; here the machine layer's links replace all of them.
        made = _run([sys.executable, "-I", "-m", "venv", "--without-pip", str(tmp)], f"creating {tmp}", timeout_s)
        if made.returncode != 0:
            raise CarryError(f"creating the base environment {tmp} failed: {made.stderr.strip()[-1500:]}")
        link_layer(baseenv.BASE_DISTRIBUTIONS, baseenv.site_packages(tmp))
        info = {"format": buildenv.ENV_FORMAT, "requirements": list(requirements),
                "interpreter": buildenv.interpreter_id(), "by": "benchmarks/gpu_carry.py seed-base (no index)"}
        (tmp / buildenv.MARKER).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")

    production = buildenv._make
    buildenv._make = linked
    try:
        return baseenv.base_env(baseenv.base_pins()).root
    finally:
        buildenv._make = production


# --- command line -----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python benchmarks/gpu_carry.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="write the carry for a target")
    prep.add_argument("--python-version", default="3.12")
    prep.add_argument("--torch-version", default="2.11.0")
    prep.add_argument("--triton-version", default="3.6.0")
    prep.add_argument("--out", type=Path, default=ROOT / ".gpu-carry")
    prep.add_argument("--limit-mib", type=float, help="override gpu_carry.toml's limit_mib")
    layer = sub.add_parser("layer", help="link the closure of the provided distributions into a folder")
    layer.add_argument("--carry", type=Path, required=True)
    layer.add_argument("--out", type=Path, required=True)
    check = sub.add_parser("check", help="refuse a machine that is not the carry's target")
    check.add_argument("--carry", type=Path, required=True)
    sub.add_parser("seed-base", help="the bench stage's base environment, without an index")
    return parser


def _manifest(carry: Path) -> dict[str, object]:
    path = carry / MANIFEST
    if not path.is_file():
        raise CarryError(f"{carry} holds no {MANIFEST}: prepare it first (benchmarks/gpu_prepare.sh)")
    loaded: dict[str, object] = json.loads(path.read_text())
    return loaded


def _dispatch(ns: argparse.Namespace) -> None:
    if ns.command == "prepare":
        spec = load_spec()
        if ns.limit_mib is not None:
            spec = CarrySpec(spec.needs, spec.provided, spec.omitted, spec.platforms, ns.limit_mib)
        target = Target(parse_python_version(ns.python_version), parse_version(ns.torch_version, "--torch-version"),
                        parse_version(ns.triton_version, "--triton-version"), spec.platforms)
        manifest = prepare(target, ns.out, spec)
        print(f"carry {ns.out}: {len(manifest['wheels'])} wheels, {manifest['bytes'] / MIB:.1f} MiB (limit "
              f"{spec.limit_mib:g} MiB), for Python {target.python_version}, torch {target.torch_version}, "
              f"Triton {target.triton_version}")
    elif ns.command == "layer":
        provided = _manifest(ns.carry)["provided"]
        assert isinstance(provided, list)
        print(f"layer {ns.out}: {len(link_layer(provided, ns.out))} entries of {', '.join(provided)} and their needs")
    elif ns.command == "check":
        check_machine(_manifest(ns.carry))
        print(f"check: Python, torch and Triton are the carry's target; {len(CHECK_IMPORTS)} modules import")
    else:
        print(f"base environment of the bench stage: {seed_base()}")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    ns = _parser().parse_args(argv)
    try:
        _dispatch(ns)
    except CarryError as exc:
        print(f"gpu_carry {ns.command}: {exc}", file=sys.stderr)
        return exc.exit_status
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
