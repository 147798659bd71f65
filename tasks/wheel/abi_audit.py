"""What a wheel's shared libraries need of torch and of CPython, from the ecosystem's auditors.

- ``torch-abi-audit`` (pinned) reads each library's undefined symbols: the unstable libtorch ones (``at::``,
  ``c10::``, ``torch::`` outside ``torch::stable``/``torch::headeronly``) and, from the stable C shims it calls,
  the minimum torch it needs.
- ``abi3audit`` (pinned) checks a wheel tagged ``abi3`` (``cp311-abi3``): every ``Py*`` symbol its extensions
  use must be in the limited API of the Python its tag names, or older.

Both run as their own command lines, in a child process group held to a deadline, on a probe directory or
wheel of the wheel's host libraries (device code, cubin or hsaco, links neither). Kiln reads their JSON
reports, never their symbol tables itself. The report is a function of the libraries' bytes, the tag's abi3
claim and the auditors' versions: the build cache keeps it under that key, so a warm build runs neither.

A wheel fails its claims (:func:`check_claims`, an :class:`AbiAuditError` naming the symbols) when its tag says
abi3 and an extension is not, or when its variant says ``abi = "stable"`` and a library uses unstable torch
symbols. A variant of ``abi = "exact"`` (the default) claims nothing of torch: its wheel pins the torch it was
built against, and its unstable symbols are reported, not refused.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from packaging.tags import parse_tag
from packaging.utils import InvalidWheelFilename, parse_wheel_filename

from kiln.core.errors import AbiAuditError, CompileError, InvalidInputError
from kiln.core.fsutil import digest, sha256_bytes
from kiln.tasks.process import run_in_group
from kiln.tasks.wheel.manylinux import elf_members, linux_platform
from kiln.tasks.wheel.stored import ResultCache

_log = logging.getLogger(__name__)

TorchUse = Literal["stable", "unstable", "no-torch"]
_DEVICE_MACHINES = frozenset({"EM_CUDA", "EM_AMDGPU"})
_TOOLS = ("abi3audit", "torch-abi-audit")
_REPORT_FORMAT = "abi-audit-2"  # bump when the probe or Kiln's reading of the reports changes
_BATCH = "abi-audit"
_TIMEOUT_S = 300
_SHOWN = 8  # symbols named per library in a message; the rest counted


@dataclass(frozen=True)
class LibraryAudit:
    """One shared library of a wheel: what it uses of torch and, in an abi3 wheel, of CPython."""

    path: str  # its name in the wheel
    torch: TorchUse
    unstable_symbols: tuple[str, ...] = ()
    min_torch: str | None = None  # from the stable shims it calls; None when it calls none
    non_abi3_symbols: tuple[str, ...] = ()  # abi3 wheels only
    abi3_needs: str | None = None  # the limited API it uses, when newer than its tag's Python
    # a Python extension (PyInit_*) or a user of any Py* symbol; a stable-ABI library loaded by
    # torch.ops.load_library uses none, and its wheel fits every Python 3 (kiln.tasks.wheel.stable_abi)
    python_api: bool = True


@dataclass(frozen=True)
class WheelAudit:
    """A wheel's libraries and what it claims: ``abi3`` (the Python its abi3 tag names) and the torch stable ABI."""

    wheel: str
    abi3: str | None
    torch_stable: bool
    libraries: tuple[LibraryAudit, ...]

    @property
    def min_torch(self) -> str | None:
        floors = [lib.min_torch for lib in self.libraries if lib.min_torch]
        return max(floors, key=lambda v: tuple(int(p) for p in v.split(".") if p.isdigit())) if floors else None

    @property
    def python_api(self) -> tuple[bool, ...]:
        """Per library, whether it uses the Python C-API."""
        return tuple(lib.python_api for lib in self.libraries)

    def findings(self) -> list[str]:
        """Every way the wheel breaks what it claims; empty when it keeps its word."""
        out = []
        for lib in self.libraries:
            if self.abi3 and lib.non_abi3_symbols:
                out.append(f"{lib.path} is tagged abi3 (cp{self.abi3.replace('.', '')}-abi3) but uses symbols"
                           f" outside the limited API: {_named(lib.non_abi3_symbols)}")
            if self.abi3 and lib.abi3_needs:
                out.append(f"{lib.path} uses the Python {lib.abi3_needs} limited API but is tagged for {self.abi3}")
            if self.torch_stable and lib.unstable_symbols:
                out.append(f"{lib.path} claims the torch stable ABI (abi = \"stable\") but uses unstable torch"
                           f" symbols: {_named(lib.unstable_symbols)}")
        return out

    def lines(self) -> list[str]:
        """The report a person reads: one line per library, then the findings."""
        claims = ", ".join(c for c in (f"abi3 (Python {self.abi3})" if self.abi3 else "",
                                       "torch stable ABI" if self.torch_stable else "") if c) or "nothing"
        out = [f"{self.wheel}: claims {claims}; minimum torch: {self.min_torch or 'n/a'}"]
        if not self.libraries:
            out.append("  no shared library to audit")
        for lib in self.libraries:
            line = f"  {lib.path}: torch {lib.torch}"
            if lib.unstable_symbols:
                line += f" ({len(lib.unstable_symbols)} unstable symbols: {_named(lib.unstable_symbols)})"
            line += f"; minimum torch {lib.min_torch}" if lib.min_torch else ""
            if self.abi3:
                line += "; abi3 " + ("violated" if lib.non_abi3_symbols or lib.abi3_needs else "compliant")
            out.append(line)
        return out + [f"  FAIL: {finding}" for finding in self.findings()]


def _named(symbols: Sequence[str]) -> str:
    shown = ", ".join(symbols[:_SHOWN])
    return shown + (f" and {len(symbols) - _SHOWN} more" if len(symbols) > _SHOWN else "")


def abi3_claim(tag: str) -> str | None:
    """The Python an ``abi3`` tag names (``cp311-abi3-…`` → ``3.11``); None for any other tag."""
    try:
        tags = parse_tag(tag)
    except ValueError as exc:
        raise InvalidInputError(f"{tag!r} is not a wheel tag: {exc}") from exc
    versions = [t.interpreter.removeprefix("cp") for t in tags if t.abi == "abi3" and t.interpreter.startswith("cp")]
    if not versions:
        return None
    best = max(versions, key=lambda v: (int(v[0]), int(v[1:] or 0)))
    return f"{best[0]}.{best[1:] or 0}"


def host_libraries(members: Sequence[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """The wheel's host shared libraries (ELF ``.so`` files, not device code), by arcname."""
    found = elf_members(members)
    return sorted((name, data) for name, (machine, data) in found.items()
                  if machine not in _DEVICE_MACHINES and _library(name))


def _library(arcname: str) -> bool:
    """A shared library's name: ``lib.so``, ``lib.so.1``."""
    return arcname.endswith(".so") or ".so." in arcname.rsplit("/", 1)[-1]


def audit_members(wheel: str, tag: str, members: Sequence[tuple[str, bytes]], *, torch_stable: bool,
                  cache: ResultCache | None = None) -> WheelAudit:
    """The audit of a wheel named ``wheel`` (tag ``tag``) of ``members``; ``cache`` keeps each report by its key."""
    abi3, libraries = abi3_claim(tag), host_libraries(members)
    if not libraries:
        return WheelAudit(wheel, abi3, torch_stable, ())
    key = digest(_REPORT_FORMAT, *(metadata.version(t) for t in _TOOLS), abi3 or "-",
                 *(f"{name}\0{sha256_bytes(data)}" for name, data in libraries))
    stored = _stored(cache, key)
    if stored is None:
        stored = _analysed(libraries, abi3)
        if cache is not None:
            cache.put(_BATCH, key, {"report.json": json.dumps([asdict(lib) for lib in stored]).encode()},
                      {"kind": "abi-audit"})
    return WheelAudit(wheel, abi3, torch_stable, stored)


def check_claims(audit: WheelAudit) -> WheelAudit:
    """``audit`` when the wheel keeps every claim; else an :class:`AbiAuditError` naming each symbol that breaks one."""
    for line in audit.lines():
        _log.info("%s", line)
    if findings := audit.findings():
        raise AbiAuditError(f"{audit.wheel} breaks the ABI it claims: " + "; ".join(findings))
    return audit


def _stored(cache: ResultCache | None, key: str) -> tuple[LibraryAudit, ...] | None:
    stored = None if cache is None else cache.file(_BATCH, key, "report.json")
    return None if stored is None else tuple(_stored_library(lib) for lib in json.loads(stored))


def _stored_library(stored: dict[str, Any]) -> LibraryAudit:
    """A library's audit as the cache keeps it (JSON: its tuples are lists)."""
    return LibraryAudit(stored["path"], stored["torch"], tuple(stored["unstable_symbols"]), stored["min_torch"],
                        tuple(stored["non_abi3_symbols"]), stored["abi3_needs"], bool(stored["python_api"]))


def _run(cmd: list[str], cwd: Path, what: str) -> str:
    """Run one auditor's command line held to its deadline; its output. Exit 0 or 1 (findings) are answers."""
    ladder, out = run_in_group(cmd, _TIMEOUT_S, cwd=cwd)
    if ladder.timed_out or ladder.returncode not in (0, 1):
        raise CompileError(f"{what} could not audit the wheel's libraries: exit {ladder.returncode}"
                           f" ({ladder.escalation}):\n{out[-2000:]}")
    return out


def _analysed(libraries: Sequence[tuple[str, bytes]], abi3: str | None) -> tuple[LibraryAudit, ...]:
    """Both auditors' reports of ``libraries``, each laid out as ``<index>/<file name>.so`` (the auditors look for
    ``*.so`` files; a report names a library by its path, so the index leads back to its arcname)."""
    with tempfile.TemporaryDirectory(prefix="kiln-abi-audit-") as tmp:
        root = Path(tmp).resolve() / "libs"
        for index, (name, data) in enumerate(libraries):
            base = name.rsplit("/", 1)[-1]
            (root / str(index)).mkdir(parents=True)
            (root / str(index) / (base if base.endswith(".so") else f"{base}.so")).write_bytes(data)
        torch = _torch_report(root, Path(tmp))
        cpython = _abi3_report(root, len(libraries), abi3, Path(tmp)) if abi3 else {}
    if sorted(torch) != list(range(len(libraries))):
        raise CompileError(f"torch-abi-audit reported {len(torch)} of the wheel's {len(libraries)} libraries")
    return tuple(LibraryAudit(name, *torch[index][:3], *cpython.get(index, ((), None)), python_api=torch[index][3])
                 for index, (name, _) in enumerate(libraries))


def _torch_report(root: Path, tmp: Path) -> dict[int, tuple[TorchUse, tuple[str, ...], str | None, bool]]:
    """torch-abi-audit's JSON report of every library under ``root``: ``{index: (use, unstable, minimum,
    python_api)}``; it lists a library defining ``PyInit_*`` under ``extensions``, any other under ``bundled_libs``,
    and a library with no ``Py*`` symbol as neither compliant nor violating the limited API."""
    out = _run([sys.executable, "-P", "-m", "torch_abi_audit.cli", str(root), "--json"], tmp, "torch-abi-audit")
    report = json.loads(out[out.index("{"):])  # its JSON is all it prints on stdout; nm says nothing on success
    found = {}
    extensions = {lib["path"] for lib in report.get("extensions", ())}
    for lib in (*report.get("extensions", ()), *report.get("bundled_libs", ())):
        path = Path(lib["path"]).relative_to(root)
        if lib.get("error"):
            raise CompileError(f"torch-abi-audit could not read {path.name}: {lib['error']}")
        torch = lib["torch"]
        use: TorchUse = "no-torch" if not torch["uses_torch"] else "stable" if torch["stable"] else "unstable"
        cpython = lib["cpython"]
        python_api = lib["path"] in extensions or bool(cpython["compliant"] or cpython["violations"])
        found[int(path.parts[0])] = (use, tuple(sorted(torch["unstable_symbols"])), torch["min_torch_version"],
                                     python_api)
    return found


def _abi3_report(root: Path, count: int, abi3: str, tmp: Path) -> dict[int, tuple[tuple[str, ...], str | None]]:
    """abi3audit's JSON report of a probe wheel tagged ``cp3X-abi3`` holding the libraries under ``root``, each
    as ``<index>_<file name>`` (its report names a library by its file name only): ``{index: (non-abi3, needs)}``."""
    probe = tmp / f"kiln_probe-0-cp{abi3.replace('.', '')}-abi3-{linux_platform()}.whl"
    result = tmp / "abi3.json"
    with zipfile.ZipFile(probe, "w", zipfile.ZIP_STORED) as archive:
        for index in range(count):
            (library,) = (root / str(index)).iterdir()
            archive.write(library, f"kiln_probe/{index}_{library.name}")
    out = _run([sys.executable, "-P", "-m", "abi3audit", "--strict", "--report", "-o", str(result), str(probe)],
               tmp, "abi3audit")
    if not result.is_file():  # --strict: a library it could not audit ends the run before the report
        raise CompileError(f"abi3audit could not audit the wheel's extensions:\n{out[-2000:]}")
    report: dict[str, Any] = json.loads(result.read_text())
    found = {}
    for entry in report["specs"][str(probe)]["wheel"]:
        verdict = entry["result"]
        needs = None if verdict["is_abi3_baseline_compatible"] else verdict["computed"]
        found[int(entry["name"].split("_", 1)[0])] = (tuple(sorted(verdict["non_abi3_symbols"])), needs)
    return found


def audit_wheel(path: Path, *, torch_stable: bool = False, cache: ResultCache | None = None) -> WheelAudit:
    """The audit of a wheel file (``kiln audit-abi``); an unreadable or misnamed one is an InvalidInputError."""
    try:
        parse_wheel_filename(path.name)
        with zipfile.ZipFile(path) as archive:
            members = [(i.filename, archive.read(i)) for i in archive.infolist()
                       if not i.is_dir() and _library(i.filename)]  # the rest is not read: a wheel may be GBs
    except (InvalidWheelFilename, OSError, zipfile.BadZipFile) as exc:
        raise InvalidInputError(f"{path}: not a readable wheel ({exc})") from exc
    tag = "-".join(path.name.removesuffix(".whl").split("-")[-3:])
    return audit_members(path.name, tag, members, torch_stable=torch_stable, cache=cache)
