"""The manylinux platform tag a native wheel's binaries allow, from ``auditwheel``'s analysis.

Kiln writes every wheel itself (:func:`kiln.tasks.wheel.assemble.write_wheel`, byte-reproducible), so it never
lets ``auditwheel repair`` rewrite the archive: it asks auditwheel's analysis (what ``auditwheel show``
reports) which policy the wheel's ELF members satisfy, then writes the wheel under that tag.

- The analysis runs on a *probe*: a stored zip of the wheel's host ELF members at their own paths and a
  RECORD naming them — auditwheel reads host ELF files only, so the verdict is the same as for the whole
  wheel. It runs in a child process (auditwheel's wheel context changes the working directory, which a
  build's threads share), held to a deadline.
- What torch, the CUDA or ROCm runtime and the driver provide is excluded (:data:`EXCLUDES`, by backend):
  those libraries come from the torch wheel and the machine, so they are never grafted, and Kiln never grafts
  anything: a library that is neither on a policy's list nor excluded keeps the wheel ``linux_<machine>``.
- A wheel whose ELF members are all device code (cubin: ``EM_CUDA``, hsaco: ``EM_AMDGPU``) links no host
  library at all, so it gets auditwheel's most compatible policy (``manylinux_2_5`` on x86_64): the tag
  states the glibc the wheel's own host binaries need, and it has none; what its device code needs (a
  driver, the Triton it was compiled with) is stated by its requirements, not by its platform tag.
- A declared target (kiln.toml ``[build] manylinux = "2_28"``) tags the wheel for it, or fails the wheel's unit
  naming each symbol whose version is newer than the target's policy allows (read from the ELF's
  ``.gnu.version_r``): the tag then says what the team promised its users, not what the build host gave.
- The verdict is a function of the ELF members' bytes, the exclude set and auditwheel's version (the key of
  its entry in the build cache), so every worker names the wheel alike and a warm build runs no analysis.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import platform
import struct
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from elftools.elf.elffile import ELFFile
from elftools.elf.enums import ENUM_E_MACHINE
from elftools.elf.gnuversions import GNUVerNeedSection, GNUVerSymSection
from elftools.elf.sections import SymbolTableSection

from kiln.core.errors import AbiAuditError, CompileError
from kiln.core.fsutil import digest, sha256_bytes
from kiln.tasks.process import run_in_group
from kiln.tasks.project.config import Backend
from kiln.tasks.wheel.stored import ResultCache

_log = logging.getLogger(__name__)

_TORCH = ("libtorch*", "libc10*", "libshm*", "libtorch_python*", "libtorch_global_deps*")
#: What a wheel of each backend may link without carrying it: torch's libraries (the torch wheel installs
#: them), the GPU runtime's and the driver's (the CUDA wheels torch requires, or the machine). auditwheel
#: matches these ``fnmatch`` patterns against each DT_NEEDED name.
EXCLUDES: dict[Backend, tuple[str, ...]] = {
    "cpu": _TORCH,
    "cuda": _TORCH + ("libcuda.so*", "libcudart*", "libnvrtc*", "libnvJitLink*", "libcublas*", "libcublasLt*",
                      "libcudnn*", "libcufft*", "libcurand*", "libcusparse*", "libcusolver*", "libnccl*",
                      "libnvToolsExt*", "libnvtx*", "libcupti*", "libnvshmem*", "libcufile*", "libnvidia-ml*"),
    "hip": _TORCH + ("libamdhip64*", "libhiprtc*", "libhsa-runtime64*", "libamd_comgr*", "librocblas*",
                     "libhipblas*", "libhipblaslt*", "libMIOpen*", "librccl*", "libroctx64*", "libroctracer64*",
                     "libhipsparse*", "libhipfft*", "libhiprand*", "librocrand*", "libhipsolver*"),
}
_DEVICE_MACHINES = frozenset({"EM_CUDA", "EM_AMDGPU"})
_VERDICT_FORMAT = "manylinux-2"  # bump when the probe or the verdict's reading changes
_BATCH = "manylinux"
_TIMEOUT_S = 300


@dataclass(frozen=True)
class PlatformVerdict:
    """The platform a wheel's binaries allow: a ``manylinux_*`` tag, or ``linux_<machine>`` and why."""

    platform: str
    reason: str = ""

    @property
    def manylinux(self) -> bool:
        return self.platform.startswith("manylinux_")


def linux_platform() -> str:
    """``linux_x86_64`` style: the build machine, claiming nothing."""
    return f"linux_{platform.machine().lower()}".replace("-", "_").replace(".", "_")


# e_machine's number -> pyelftools' name for it, as its header parser decodes it (an unknown one: the number)
_MACHINE_NAMES = {number: name for name, number in ENUM_E_MACHINE.items() if name != "_default_"}
_HEADER_SIZE = {1: 52, 2: 64}  # ELFCLASS32, ELFCLASS64


def _machine(data: bytes) -> str | None:
    """The ELF machine of ``data`` (``EM_X86_64``, ``EM_CUDA``…); None for anything that is not an ELF file.

    Read from the header's own bytes: pyelftools' ``ELFFile`` gives the same answer and refuses the same
    files (an unknown class or byte order, a header cut short), but builds its parser for every file, which
    was a third of a warm build's wheel assembly (a wheel of the default project has a hundred cubins).
    """
    if data[:4] != b"\x7fELF" or len(data) < 6:
        return None
    size, order = _HEADER_SIZE.get(data[4]), {1: "<", 2: ">"}.get(data[5])
    if size is None or order is None or len(data) < size:
        return None
    (number,) = struct.unpack_from(f"{order}H", data, 18)
    return str(_MACHINE_NAMES.get(number, number))


def elf_members(members: Sequence[tuple[str, bytes]]) -> dict[str, tuple[str, bytes]]:
    """``{arcname: (ELF machine, bytes)}`` of the members that are ELF files."""
    return {name: (machine, data) for name, data in members if (machine := _machine(data)) is not None}


@functools.cache
def most_compatible() -> str:
    """auditwheel's most compatible glibc policy for this machine (``manylinux_2_5_x86_64`` on x86_64)."""
    from auditwheel.architecture import Architecture
    from auditwheel.libc import Libc
    from auditwheel.policy import WheelPolicies

    return str(WheelPolicies(libc=Libc.GLIBC, arch=Architecture(platform.machine())).highest.name)


def verdict_key(elves: Sequence[tuple[str, bytes]], backend: Backend) -> str:
    return digest(_VERDICT_FORMAT, metadata.version("auditwheel"), platform.machine(), *EXCLUDES[backend],
                  *(f"{name}\0{sha256_bytes(data)}" for name, data in sorted(elves)))


def platform_verdict(members: Sequence[tuple[str, bytes]], backend: Backend,
                     cache: ResultCache | None = None) -> PlatformVerdict:
    """The platform ``members`` (a wheel's, arcname and bytes) allow; ``linux_<machine>`` with a reason when
    no manylinux policy fits. ``cache``: the build cache that keeps each verdict by its key."""
    found = elf_members(members)
    if not found:
        return PlatformVerdict(linux_platform(), "no ELF binary in the wheel: nothing for auditwheel to judge")
    if all(machine in _DEVICE_MACHINES for machine, _ in found.values()):
        return PlatformVerdict(most_compatible(), "device code only (cubin/hsaco): no host library linked")
    # device code links nothing: auditwheel would skip it, and the verdict's key does not depend on it
    elves = [(name, data) for name, (machine, data) in found.items() if machine not in _DEVICE_MACHINES]
    key = verdict_key(elves, backend)
    stored = _stored(cache, key)
    if stored is not None:
        return stored
    verdict = _analysed(elves, backend)
    if cache is not None:
        cache.put(_BATCH, key, {"verdict.json": json.dumps(asdict(verdict)).encode()}, {"kind": "manylinux"})
    return verdict


def manylinux_tag(tag: str, members: Sequence[tuple[str, bytes]], backend: Backend,
                  cache: ResultCache | None = None, target: str | None = None) -> str:
    """``tag`` (``py3-none-linux_x86_64``, ``cp311-cp311-linux_x86_64``) with its plain ``linux_<machine>``
    platform replaced by the manylinux one ``members`` allow; any other tag (``any``, a tag a backend already
    audited) as it is. A wheel that stays ``linux_<machine>`` is logged with the reason.

    ``target`` (``"2_28"``, kiln.toml ``[build] manylinux``): the wheel is tagged ``manylinux_<target>`` when its
    binaries allow that policy or an older one, else :class:`~kiln.core.errors.AbiAuditError` names what does
    not (the symbols and versions newer than the target's, or auditwheel's reason)."""
    interpreter, abi, platforms = tag.split("-")
    if platforms != linux_platform():
        if target is not None and platforms != "any":  # a tag the backend chose still meets the target
            _refuse_newer(members, target)
        return tag
    verdict = platform_verdict(members, backend, cache)
    if target is not None:
        return f"{interpreter}-{abi}-{meet_target(verdict, members, target)}"
    if not verdict.manylinux:
        _log.warning("the wheel stays %s: %s", verdict.platform, verdict.reason)
        return tag
    _log.info("the wheel's binaries allow %s (auditwheel; %s)", verdict.platform, verdict.reason or "analysed")
    return f"{interpreter}-{abi}-{verdict.platform}"


def target_policy(target: str) -> Any:
    """auditwheel's policy ``manylinux_<target>_<machine>`` (its symbol versions); config has checked it exists."""
    from auditwheel.architecture import Architecture
    from auditwheel.libc import Libc
    from auditwheel.policy import WheelPolicies

    arch = Architecture(platform.machine())
    return WheelPolicies(libc=Libc.GLIBC, arch=arch).get_policy_by_name(f"manylinux_{target}_{arch.value}")


def _glibc(policy_name: str) -> tuple[int, int]:
    """``manylinux_2_28_x86_64`` -> (2, 28)."""
    major, minor = policy_name.split("_")[1:3]
    return int(major), int(minor)


def meet_target(verdict: PlatformVerdict, members: Sequence[tuple[str, bytes]], target: str) -> str:
    """The platform of a wheel that must meet ``manylinux_<target>``: the target's own tag when the binaries
    allow it (an older policy meets it too), else an :class:`AbiAuditError` naming why not."""
    policy = target_policy(target)
    if verdict.manylinux and _glibc(verdict.platform) <= _glibc(policy.name):
        return str(policy.name)
    _refuse_newer(members, target)
    raise _missed(target, verdict.reason or f"its binaries need {verdict.platform}")


def _refuse_newer(members: Sequence[tuple[str, bytes]], target: str) -> None:
    """Raise :class:`AbiAuditError` naming every symbol of ``members`` newer than the target's policy allows."""
    policy = target_policy(target)
    too_new = newer_symbols(members, policy.symbol_versions)
    if too_new:
        named = "; ".join(f"{arcname}: {', '.join(symbols)}" for arcname, symbols in too_new.items())
        raise _missed(target, f"needs symbol versions newer than {policy.name} allows: {named}")


def _missed(target: str, why: str) -> AbiAuditError:
    return AbiAuditError(f"the wheel's binaries do not meet the manylinux target {target} (kiln.toml [build] "
                         f"manylinux): {why}. Build on a worker whose glibc and libstdc++ are at most the target's "
                         f"(e.g. the manylinux_{target} build image), or raise the target.")


def newer_symbols(members: Sequence[tuple[str, bytes]],
                  allowed: dict[str, frozenset[str]]) -> dict[str, list[str]]:
    """``{arcname: ["dlopen@GLIBC_2.34", ...]}``: each host ELF member's undefined symbols whose version is in
    a namespace the policy lists (GLIBC, GLIBCXX, CXXABI, GCC...) but is not one the policy allows."""
    found: dict[str, list[str]] = {}
    for name, (machine, data) in sorted(elf_members(members).items()):
        if machine in _DEVICE_MACHINES:
            continue
        needs = sorted(f"{symbol}@{version}" for symbol, version in _versioned_needs(data)
                       if (space := version.partition("_")[0]) in allowed
                       and version.partition("_")[2] not in allowed[space])
        if needs:
            found[name] = needs
    return found


def _versioned_needs(data: bytes) -> list[tuple[str, str]]:
    """(symbol, version) of every undefined dynamic symbol of the ELF file ``data`` that names a version."""
    elf = ELFFile(io.BytesIO(data))
    need, versym, dynsym = (elf.get_section_by_name(n) for n in (".gnu.version_r", ".gnu.version", ".dynsym"))
    if not (isinstance(need, GNUVerNeedSection) and isinstance(versym, GNUVerSymSection)
            and isinstance(dynsym, SymbolTableSection)):
        return []
    names = {aux.entry["vna_other"]: aux.name for _, auxes in need.iter_versions() for aux in auxes}
    out = []
    for index, symbol in enumerate(dynsym.iter_symbols()):
        ndx = versym.get_symbol(index).entry["ndx"]
        if symbol["st_shndx"] == "SHN_UNDEF" and isinstance(ndx, int) and (ndx & 0x7FFF) in names:
            out.append((symbol.name, names[ndx & 0x7FFF]))
    return out


def wheel_file_tagged(wheel_file: bytes, tag: str) -> bytes:
    """A backend's ``WHEEL`` file with each ``Tag:`` line on the plain linux platform moved to ``tag``'s
    platform; every other byte kept."""
    new, old = f"-{tag.rsplit('-', 1)[1]}".encode(), f"-{linux_platform()}".encode()
    lines = wheel_file.split(b"\n")
    for i, line in enumerate(lines):
        body = line.rstrip(b"\r")
        if body.startswith(b"Tag:") and body.endswith(old):
            lines[i] = body[: -len(old)] + new + line[len(body):]
    return b"\n".join(lines)


def why_not_manylinux(wheel: Path, backend: Backend, cache: ResultCache | None = None) -> str:
    """Why a wheel Kiln wrote is ``linux_<machine>`` (its verdict, from the cache after the build); empty for
    any other platform."""
    if not wheel.name.removesuffix(".whl").endswith(f"-{linux_platform()}"):
        return ""
    with zipfile.ZipFile(wheel) as archive:
        members = [(info.filename, archive.read(info)) for info in archive.infolist() if not info.is_dir()]
    return platform_verdict(members, backend, cache).reason


def _stored(cache: ResultCache | None, key: str) -> PlatformVerdict | None:
    stored = None if cache is None else cache.file(_BATCH, key, "verdict.json")
    return PlatformVerdict(**json.loads(stored)) if stored is not None else None


def _analysed(elves: Sequence[tuple[str, bytes]], backend: Backend) -> PlatformVerdict:
    """Run auditwheel's analysis on a probe of ``elves`` in a child process, held to its deadline."""
    with tempfile.TemporaryDirectory(prefix="kiln-manylinux-") as tmp:
        probe, result = Path(tmp) / f"kiln_probe-0-py3-none-{linux_platform()}.whl", Path(tmp) / "result.json"
        with zipfile.ZipFile(probe, "w", zipfile.ZIP_STORED) as archive:
            for name, data in elves:
                archive.writestr(name, data)
            archive.writestr("kiln_probe-0.dist-info/RECORD", "".join(f"{name},,\n" for name, _ in elves))
        cmd = [sys.executable, "-P", "-m", __name__, str(probe), str(result), _host_libc(), *EXCLUDES[backend]]
        ladder, out = run_in_group(cmd, _TIMEOUT_S)
        if ladder.timed_out or ladder.returncode != 0 or not result.is_file():
            raise CompileError(f"auditwheel could not analyse the wheel's binaries ({', '.join(n for n, _ in elves)}):"
                               f" exit {ladder.returncode} ({ladder.escalation}):\n{out[-2000:]}")
        return _verdict(json.loads(result.read_text()))


def _verdict(report: dict[str, Any]) -> PlatformVerdict:
    """Kiln's reading of the child's report: the policy, or ``linux_<machine>`` and every reason it is."""
    if report.get("error"):
        return PlatformVerdict(linux_platform(), f"auditwheel: {report['error']}")
    if report["overall"].startswith("manylinux_"):
        return PlatformVerdict(report["overall"])
    reasons = []
    if report["libs"]:
        reasons.append(f"links {', '.join(report['libs'])}, which no manylinux policy allows and Kiln never grafts")
    if not report["symbols_fit"]:
        reasons.append(f"needs symbol versions newer than any manylinux policy: {report['symbols']}")
    if report["blacklisted"]:
        reasons.append(f"uses symbols no manylinux policy allows: {report['blacklisted']}")
    if not report["isa_fits"]:
        reasons.append("needs instruction set extensions beyond the architecture's baseline")
    return PlatformVerdict(report["overall"], "; ".join(reasons) or "auditwheel allows no manylinux policy")


def _host_libc() -> str:
    """The build host's C library as auditwheel names it ("glibc"), or "" to let auditwheel read it from the
    binaries. auditwheel reads it from the libc each binary links; a CPython extension that calls only the
    Python C-API (common with a pyenv-built interpreter, whose modules get libc's symbols through the
    interpreter) links none, and auditwheel then "couldn't detect libc" and allows no policy at all. The wheel
    was built against this host's libc, so that is the one to judge it by."""
    return "glibc" if platform.libc_ver()[0] == "glibc" else ""


def _report(probe: Path, exclude: frozenset[str], libc_name: str = "") -> dict[str, Any]:
    """auditwheel's analysis of ``probe`` (what ``auditwheel show --json`` reports), grafting nothing."""
    from auditwheel.error import AuditwheelError
    from auditwheel.libc import Libc
    from auditwheel.wheel_abi import analyze_wheel_abi

    libc = Libc(libc_name) if libc_name else None
    try:
        info = analyze_wheel_abi(libc, None, probe, exclude, disable_isa_ext_check=False, allow_graft=False)
    except (AuditwheelError, RuntimeError) as exc:  # a library in purelib, an unknown libc
        return {"error": " ".join(str(getattr(exc, "message", exc)).split())}
    policies = info.policies
    best = policies.highest.name
    return {"overall": info.overall_policy.name,
            "libs": sorted(info.external_refs[best].libs),
            "symbols_fit": info.sym_policy != policies.linux,
            "symbols": {lib: sorted(v) for lib, v in sorted(info.versioned_symbols.items())},
            "blacklisted": {lib: sorted(v) for lib, v in sorted(info.external_refs[best].blacklist.items())},
            "isa_fits": info.machine_policy != policies.linux}


def main(argv: Sequence[str]) -> int:
    probe, result, libc_name, *exclude = argv
    Path(result).write_text(json.dumps(_report(Path(probe), frozenset(exclude), libc_name)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
