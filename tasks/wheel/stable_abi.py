"""The LibTorch stable-ABI mode of a variant (``abi = "stable"``): what its build is told, and
what its wheel asks of torch.

A stable variant is built once per backend (not once per torch) against the torch of its build environment,
with the torch it targets passed to the compiler the way torch's own headers read it
(``-DTORCH_TARGET_VERSION=0x020d000000000000`` for 2.13: ``torch/csrc/stable/version.h``; torch's
``cpp_extension`` does not read it from the environment), so the stable headers call only the C shims that
torch already had. The target is the variant's ``torch_target``, else the major.minor of the torch it builds
against. The define reaches every compiler a package's build may run: ``CPPFLAGS`` (setuptools and
autotools add it to each C/C++ compile without replacing their own flags, as ``CXXFLAGS`` would),
``NVCC_APPEND_FLAGS`` and ``HIPCC_COMPILE_FLAGS_APPEND``; ``TORCH_TARGET_VERSION`` itself is exported for a
CMake project to pass on (``-DTORCH_TARGET_VERSION=$ENV{TORCH_TARGET_VERSION}``).

Its wheel requires ``torch>=<floor>``: the higher of the target and the minimum torch the ABI audit
(``torch-abi-audit``) reports for its libraries. A wheel of an ``abi = "exact"`` variant, whose libraries use
torch's C++ ABI, requires the torch release series it was built against, ``torch==2.14.*``: torch keeps its
C++ ABI within a minor release (its patch releases are fixes), and breaks it between minor releases.
A stable wheel is abi3 where its package builds with ``py_limited_api`` (``abi3audit`` checks the claim), and
one whose libraries use no Python C-API at all (a library loaded with ``torch.ops.load_library``) is tagged
``py3-none-<platform>``: one wheel for every Python 3.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

from packaging.version import InvalidVersion, Version

from kiln.core.errors import ConfigError

TARGET_VARIABLE = "TORCH_TARGET_VERSION"
# The compilers' own variables that carry a define into a package's build; appended to, never replaced.
_FLAG_VARIABLES = ("CPPFLAGS", "NVCC_APPEND_FLAGS", "HIPCC_COMPILE_FLAGS_APPEND")


def series(version: str) -> str:
    """``2.14.1+cu130`` -> ``2.14``: the release series (major.minor) of a torch version."""
    try:
        release = Version(version).release
    except InvalidVersion as exc:
        raise ConfigError(f"{version!r} is not a torch version (PEP 440)") from exc
    return f"{release[0]}.{release[1] if len(release) > 1 else 0}"


def target_hex(version: str) -> str:
    """The value torch's headers compare ``TORCH_TARGET_VERSION`` with: ``2.13`` -> ``0x020d000000000000``
    (major and minor in the two high bytes, as ``torch/headeronly/version.h`` packs ``TORCH_ABI_VERSION``)."""
    major, minor = (int(part) for part in series(version).split("."))
    if major > 0xFF or minor > 0xFF:
        raise ConfigError(f"torch {version!r} does not fit TORCH_TARGET_VERSION (one byte each for major and minor)")
    return f"0x{major:02x}{minor:02x}000000000000"


def build_target(declared: str | None, built: str) -> str:
    """The torch a stable build targets: the variant's ``torch_target``, else the series of the torch it builds
    against. A target newer than that torch is refused: its headers cannot know the shims it would promise."""
    target = series(declared or built)
    if Version(target) > Version(series(built)):
        raise ConfigError(f"torch_target = {declared!r} is newer than the torch the variant builds against"
                          f" ({built}): build against torch {target} or later, or lower the target")
    return target


def stable_environ(environ: Mapping[str, str], target: str) -> dict[str, str]:
    """``environ`` with the target's define added to each compiler's variable and ``TORCH_TARGET_VERSION`` set."""
    value = target_hex(target)
    env = dict(environ)
    env[TARGET_VARIABLE] = value
    for name in _FLAG_VARIABLES:
        env[name] = " ".join(filter(None, [env.get(name, ""), shlex.quote(f"-D{TARGET_VARIABLE}={value}")]))
    return env


def torch_specifier(stable: bool, built: str, declared: str | None, audited: str | None) -> str:
    """What a torch extension's wheel asks of torch: ``==2.14.*`` (its build's series) for an exact variant;
    ``>=<floor>`` for a stable one, the floor the higher of its target and the audit's minimum torch."""
    if not stable:
        return f"=={series(built)}.*"
    floors = [Version(build_target(declared, built))] + ([Version(audited)] if audited else [])
    return f">={max(floors)}"


def untied_tag(tag: str, python_api: Sequence[bool]) -> str:
    """``cp311-cp311-<platform>`` or ``cp310-abi3-<platform>`` -> ``py3-none-<platform>`` when no library of the
    wheel uses the Python C-API (``python_api``: one flag per library, at least one): a library torch loads
    (``torch.ops.load_library``) is bound to no Python, and an abi3 tag would still refuse a Python older than
    the one it names. Any other tag (a library that is a Python extension, already ``py3-none``) as it is."""
    interpreter, abi, platform = tag.split("-")
    if not python_api or any(python_api) or abi == "none" or not interpreter.startswith("cp"):
        return tag
    return f"py3-none-{platform}"


def wheel_file_retagged(wheel_file: bytes, tag: str) -> bytes:
    """A ``WHEEL`` file whose ``Tag:`` lines say ``tag`` alone (the first one rewritten, any others dropped)."""
    out, tagged = [], False
    for line in wheel_file.split(b"\n"):
        if line.startswith(b"Tag:"):
            if not tagged:
                out.append(b"Tag: " + tag.encode() + (b"\r" if line.endswith(b"\r") else b""))
            tagged = True
            continue
        out.append(line)
    return b"\n".join(out)
