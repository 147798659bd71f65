"""Package code is a guest: the environment and the sandbox of every process that runs it.

A build backend and its requirements, a compile worker importing a registry, an sdist hook, a test, a conftest
or a benchmark runs with:

- **an allow-listed environment** (:func:`guest_env`): the toolchain's, locale and Python variables, what Kiln
  itself set for the step, the names the project lists in ``pass_env``; a private ``HOME`` and ``TMPDIR``.
  Never a credential, a CI identity or a Prefect variable (:func:`credential_name`), whoever set it.
- **a sandbox** (:func:`wrap`): the command starts under ``python -I -m kiln.core.sandbox POLICY -- CMD``, which
  enters a user and network namespace of its own (no route out: builds get no network at all, tests and
  benchmarks their own loopback), restricts itself with Landlock (:mod:`kiln.core.landlock`: read the system,
  the interpreters and the trees the step names; write only the step's scratch and outputs; no ptrace of,
  nor signal to, a process outside), then ``exec``\\ s the command. The user namespace also takes root's powers
  over the machine away from a guest started by root (no reboot, no module load, no sysctl).

Why Landlock and namespaces rather than bubblewrap: both are in the kernel and need no root and no setuid
binary to install; Landlock binds root too and a process applies it to itself just before ``exec``, so any
command line Kiln already runs is wrapped by a prefix. Where the kernel lacks one of them, :func:`support` says
what is missing and Kiln warns once naming it; the command still runs with what the kernel allows.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import importlib.util
import json
import logging
import os
import re
import socket
import struct
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlparse

from kiln.core import landlock

log = logging.getLogger(__name__)

# "host": the machine's network, for an installer that fetches from an index (its sdist builds still get no
# file of the user's and no credential); "loopback": a network of its own; "none": no interface at all.
Network = Literal["none", "loopback", "host"]

# What a guest needs of the caller's environment, by name: the toolchain, the locale, the interpreter's own
# switches, the devices it may use. Anything else reaches it only because Kiln set it for the step or the
# project named it in ``pass_env``.
KEPT = frozenset({
    "PATH", "LANG", "LANGUAGE", "TZ", "TERM", "USER", "LOGNAME", "SHELL",
    "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONFAULTHANDLER", "PYTHONWARNINGS",
    "SOURCE_DATE_EPOCH", "MAX_JOBS", "CMAKE_BUILD_PARALLEL_LEVEL", "MAKEFLAGS",
    "CC", "CXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "LD_LIBRARY_PATH", "LIBRARY_PATH", "CPATH",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
    "PYTORCH_NVCC", "TORCH_CUDA_ARCH_LIST", "PYTORCH_ROCM_ARCH",
    "ROCM_PATH", "ROCM_HOME", "HIP_PATH", "HIP_PLATFORM", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
})
KEPT_PREFIXES = ("LC_", "CUDA", "NVCC_", "TRITON_", "NCCL_", "KILN_ARCH", "CCACHE_")
# Never passed, whoever set it: cloud, registry, CI-identity and Prefect secrets by their conventional names.
_CREDENTIAL = re.compile(
    r"^(AWS_|PREFECT_|GOOGLE_|GCLOUD_|CLOUDSDK_|AZURE_|TWINE_|GITHUB_|ACTIONS_|GITLAB_|CI_JOB_|UV_PUBLISH_"
    r"|HF_TOKEN|HUGGING_FACE_HUB_TOKEN|NETRC|SSH_AUTH_SOCK|DOCKER_AUTH|KILN_PYPI|PYPI_)"
    r"|(_API_KEY|_ACCESS_KEY|_CREDENTIALS|_AUTH|_AUTH_STRING)$"
    r"|(^|_)(TOKEN|SECRET|PASSWORD|PASSWD)(_|$)")


def credential_name(name: str) -> bool:
    """Whether ``name`` is a variable no guest may see (a credential, an identity, a Prefect setting)."""
    return bool(_CREDENTIAL.search(name.upper()))


def guest_env(env: Mapping[str, str], home: Path, pass_env: Iterable[str] = (),
              inherited: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a guest process sees of ``env``: the :data:`KEPT` names, what differs from ``inherited`` (default:
    this process's environment; what Kiln set for the step), the names in ``pass_env``; never a
    :func:`credential_name`. ``HOME`` and ``TMPDIR`` are ``home`` and ``home/tmp`` (made here, owner-only)."""
    inherited = os.environ if inherited is None else inherited
    passed = set(pass_env)
    kept = {key: value for key, value in env.items()
            if not credential_name(key)
            and (key in KEPT or key.startswith(KEPT_PREFIXES) or key in passed or inherited.get(key) != value)}
    for key in [k for k in kept if k.startswith("XDG_")]:
        del kept[key]
    tmp = home / "tmp"
    tmp.mkdir(mode=0o700, parents=True, exist_ok=True)
    return kept | {"HOME": str(home), "TMPDIR": str(tmp), "TMP": str(tmp), "TEMP": str(tmp)}


@dataclass(frozen=True)
class Policy:
    """What a guest may read and write, and its network."""

    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    network: Network = "none"
    # the system trees a program needs to start, read-only; /dev and /proc as below
    system: tuple[str, ...] = field(default=("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin",
                                             "/etc", "/opt", "/sys"))
    cwd: str = ""  # where the guest starts ("": where it was started); a tool that reads its working directory
    # (uv looks there for its configuration) must start where it may read

    def to_json(self) -> str:
        return json.dumps({"read": list(self.read), "write": list(self.write), "network": self.network,
                           "system": list(self.system), "cwd": self.cwd})

    @classmethod
    def from_json(cls, text: str) -> Policy:
        data = json.loads(text)
        return cls(tuple(data["read"]), tuple(data["write"]), data["network"], tuple(data["system"]),
                   str(data.get("cwd", "")))


def interpreter_trees(python: str | os.PathLike[str]) -> set[str]:
    """The directories an interpreter reads to start and import: its environment, its base installation, and
    every directory a ``.pth`` of its site-packages adds (layered environments), followed once."""
    exe = Path(python)
    trees: set[str] = {str(exe.parent.parent), str(exe.resolve().parent.parent)}
    cfg = exe.parent.parent / "pyvenv.cfg"
    if cfg.is_file():
        for line in cfg.read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home" and value.strip():
                home = Path(value.strip())
                trees |= {str(home.parent), str(home.resolve().parent)}
    for site in (exe.parent.parent / "lib").glob("python3*/site-packages"):
        trees |= _pth_dirs(site)
    return trees


def _pth_dirs(site: Path) -> set[str]:
    found: set[str] = set()
    for pth in site.glob("*.pth"):
        for line in pth.read_text(errors="replace").splitlines():
            line = line.strip()
            if line and not line.startswith(("#", "import ")) and os.path.isabs(line) and os.path.isdir(line):
                found.add(line)
    return found


_KILN_PACKAGES = ("kiln.core", "kiln.tasks", "kiln.flows", "kiln.release", "kiln.runtime")


def kiln_trees() -> set[str]:
    """Where Kiln's own code is read from (a guest runs Kiln's test server and compile worker modules): the
    interpreter's path and each of Kiln's package folders, never the checkout around them (an editable
    install's checkout may hold a ``file://`` store or the build cache)."""
    trees = {str(Path(p)) for p in sys.path if p and os.path.isabs(p) and os.path.isdir(p)}
    for name in _KILN_PACKAGES:
        spec = importlib.util.find_spec(name)
        trees |= {str(Path(folder).resolve()) for folder in (spec.submodule_search_locations or [])} if spec else set()
    return trees | interpreter_trees(sys.executable)


@dataclass(frozen=True)
class Support:
    """What this kernel lets a guest be confined by."""

    landlock_abi: int
    namespaces: bool
    why_not: str = ""

    def missing(self, network: Network) -> list[str]:
        gaps = []
        if self.landlock_abi == 0:
            gaps.append("Landlock (files: the guest can read the user's home and Kiln's state)")
        if not self.namespaces and network != "host":
            net = ("TCP is refused by Landlock, UDP is not" if self.landlock_abi >= 4 and network == "none"
                   else "the guest reaches the network")
            gaps.append(f"network and user namespaces ({self.why_not}: {net})")
        return gaps


CONFINEMENT_INFO = "confinement:"  # run info key prefix (+ "<stage>@<host>"): how that step could confine guests
STAGE_NETWORK: dict[str, Network] = {"build": "none", "test": "loopback", "bench": "loopback"}


def confinement(network: Network) -> dict[str, Any]:
    """How this machine confines a guest given ``network``, for the run record: the Landlock ABI, whether it gets
    namespaces of its own, and each mechanism it goes without (empty: fully confined)."""
    found = support()
    return {"landlock_abi": found.landlock_abi, "namespaces": found.namespaces, "network": network,
            "gaps": found.missing(network)}


@functools.cache
def support() -> Support:
    """What the kernel allows, probed once per process by the launcher itself (so the probe is the real path)."""
    try:
        done = subprocess.run([sys.executable, "-I", "-m", "kiln.core.sandbox", "--probe"], capture_output=True,
                              text=True, timeout=30)
        data = json.loads(done.stdout)
        return Support(int(data["landlock_abi"]), bool(data["namespaces"]), str(data.get("why_not", "")))
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError) as exc:
        return Support(landlock.abi(), False, f"the sandbox probe failed: {exc}")


_warned: set[str] = set()


def wrap(cmd: Sequence[str], policy: Policy) -> list[str]:
    """``cmd`` started inside the sandbox ``policy`` describes; warns once per missing mechanism."""
    for gap in support().missing(policy.network):
        if gap not in _warned:
            _warned.add(gap)
            log.warning("package code runs without %s: this kernel does not allow it", gap)
    return [sys.executable, "-I", "-m", "kiln.core.sandbox", policy.to_json(), "--", *cmd]


_PR_SET_DUMPABLE = 4


def seal_environ() -> None:
    """Make this process non-dumpable: its ``/proc/<pid>/environ`` and memory are then unreadable to other
    processes of the same (non-root) user, so code Kiln runs outside the sandbox (an installer building an
    sdist) cannot read the step's credentials from its parent. Guests are kept out by Landlock anyway."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        log.debug("prctl(PR_SET_DUMPABLE, 0) failed: %s", os.strerror(ctypes.get_errno()))


# --- how a step starts package code ---------------------------------------------------------------------------
# Every process that runs the package's or a third party's code (a test worker, a benchmark's measuring process,
# a build backend, a compile worker, an sdist hook) is started as guest_command(...) with guest_environ(...).


def guest_command(cmd: Sequence[str], *, read: Iterable[str | os.PathLike[str]] = (),
                  write: Iterable[str | os.PathLike[str]] = (), network: Network,
                  cwd: str | os.PathLike[str] = "") -> list[str]:
    """``cmd`` (its first word an interpreter or a program) inside the sandbox: read ``read``, the interpreter's
    trees and Kiln's code; write ``write``."""
    trees = kiln_trees() | {str(Path(p)) for p in read}
    if cmd and Path(cmd[0]).is_absolute():
        trees |= interpreter_trees(cmd[0]) if Path(cmd[0]).name.startswith("python") else {str(Path(cmd[0]).parent)}
    policy = Policy(read=tuple(sorted(trees)), write=tuple(sorted({str(Path(p)) for p in write})), network=network,
                    cwd=str(cwd) if cwd else "")
    return wrap(cmd, policy)


def guest_environ(home: Path, extra: Mapping[str, str] | None = None, pass_env: Iterable[str] = (),
                  base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allow-listed environment of a guest: of ``base`` (default: this process's) plus ``extra``, with a
    private ``HOME``/``TMPDIR`` at ``home``."""
    return guest_env({**(os.environ if base is None else base), **(extra or {})}, home, pass_env)


def local_sources(sources: Iterable[str]) -> list[Path]:
    """The folders and files of installer sources (index and find-links URLs, constraint files) that are on this
    machine: ``file://`` URLs and absolute paths that exist."""
    found = []
    for source in sources:
        path = Path(unquote(urlparse(source).path)) if source.startswith("file:") else Path(source)
        if source.startswith(("file:", "/")) and path.exists():
            found.append(path)
    return found


# The variables through which an installer's sources and pins reach it (folders, files, file:// URLs): what they
# name on this machine is readable to the guest (the offline GPU check points UV_OVERRIDE at its carry's pins).
_INSTALLER_SOURCES = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_CONFIG_FILE",
                      "PIP_CERT", "SSL_CERT_FILE", "SSL_CERT_DIR", "UV_CONSTRAINT", "UV_OVERRIDE",
                      "UV_BUILD_CONSTRAINT", "UV_FIND_LINKS", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_INDEX",
                      "UV_DEFAULT_INDEX", "UV_CONFIG_FILE")
_INSTALLER_CACHES = ("UV_CACHE_DIR", "PIP_CACHE_DIR")


WHEELS_ONLY = ("Kiln's installers take only wheels from an index (an sdist's build hook is someone else's code, and"
               " an installer has the machine's network): a requirement that publishes no wheel for this machine"
               " needs one built where its hook may run (pip wheel --no-deps NAME, in an environment without"
               " credentials) into a folder pip's configuration names as find-links")
# What pip and uv print when the only distribution they found is an sdist they may not build
_NO_WHEEL = ("No matching distribution found", "has no usable wheels", "building from source is disabled")


def wheels_only_hint(output: str) -> str:
    """`` (WHEELS_ONLY)`` where an installer's ``output`` says it found nothing it may take, else ``""``."""
    return f" ({WHEELS_ONLY})" if any(marker in output for marker in _NO_WHEEL) else ""


def wheels_only(cmd: Sequence[str]) -> list[str]:
    """``cmd`` (``pip install`` or ``uv pip install``) taking only wheels from its indexes (``--only-binary
    :all:``): no index package's code runs while it installs. pip still builds a local directory or sdist the
    command names: Kiln names the wheel it built of one without network instead."""
    at = next((i for i in range(len(cmd) - 1) if cmd[i] == "pip" and cmd[i + 1] == "install"), None)
    return list(cmd) if at is None else [*cmd[:at + 2], "--only-binary", ":all:", *cmd[at + 2:]]


def installer_command(cmd: Sequence[str], python: str | os.PathLike[str], env: Mapping[str, str], *,
                      read: Iterable[str | os.PathLike[str]] = (),
                      write: Iterable[str | os.PathLike[str]] = ()) -> tuple[list[str], dict[str, str]]:
    """``cmd``, an installer (pip or uv) filling ``python``'s environment with ``env`` (already scrubbed of
    credentials), as a guest on the machine's network, wheels only from its indexes (:func:`wheels_only`), and the
    environment to run it with (its temporary files under ``env``'s ``HOME``). It reads only the system, the
    interpreters, its sources (those ``env`` names, the local files ``cmd`` names, and ``read``) and its cache, and
    writes only ``write``, the cache and ``HOME``. The cache is the user's, so a warm install stays warm. pip would
    build a local source ``cmd`` names (a directory, an sdist file) with this network: Kiln's callers build those
    first without one and name the wheel (``kiln.tasks.build.guest_install.offline_wheels``); uv refuses one."""
    caches = [Path(env[name]) for name in _INSTALLER_CACHES if env.get(name)]
    for cache in caches:
        cache.mkdir(parents=True, exist_ok=True)
    home = Path(env["HOME"])
    tmp = home / "tmp"
    tmp.mkdir(mode=0o700, parents=True, exist_ok=True)
    named = [word.rpartition("@ ")[2].strip() for word in cmd]  # a path, a file:// URL, "name @ file://..."
    sources = local_sources([*named, *(word for name in _INSTALLER_SOURCES for word in env.get(name, "").split())])
    # It starts in its home: uv reads its working directory for a configuration file, and the caller's may be
    # a checkout the guest must not read (nor take its configuration from).
    command = guest_command(wheels_only(cmd), read=[*interpreter_trees(python), *sources, *read],
                            write=[*write, *caches, home], network="host", cwd=home)
    return command, {**env, "TMPDIR": str(tmp), "TMP": str(tmp), "TEMP": str(tmp)}


# --- inside the launcher: between fork and the guest's exec ---------------------------------------------------

_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def _namespaces(network: Network) -> str:
    """Enter a new user namespace and, unless ``network`` is the host's, a network namespace (this process keeps
    its uid and gid); '' or why not."""
    uid, gid = os.getuid(), os.getgid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWUSER | (0 if network == "host" else _CLONE_NEWNET)) != 0:
        return f"unshare: {os.strerror(ctypes.get_errno())}"
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as handle:
            handle.write(text)
    return ""


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = struct.unpack("16sh", fcntl.ioctl(sock, _SIOCGIFFLAGS, struct.pack("16sh14x", b"lo", 0))[:18])[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sh14x", b"lo", flags | _IFF_UP))


def _rules(policy: Policy) -> list[landlock.Rule]:
    dev = landlock.READ | landlock.WRITE_FILE | landlock.TRUNCATE | landlock.IOCTL_DEV
    rules = [landlock.Rule(Path(p), landlock.READ) for p in (*policy.system, *policy.read)]
    rules += [landlock.Rule(Path("/proc"), landlock.READ), landlock.Rule(Path("/dev"), dev)]
    everything = landlock.fs_rights(6)
    rules += [landlock.Rule(Path(p), everything) for p in (*policy.write, "/dev/shm")]
    return rules


def confine(policy: Policy) -> Support:
    """Confine this process as ``policy`` says, as far as the kernel allows; what it could apply."""
    why = _namespaces(policy.network)
    if not why and policy.network == "loopback":
        _loopback_up()
    version = landlock.abi()
    if version:
        landlock.restrict(_rules(policy), deny_tcp=bool(why) and policy.network == "none", version=version)
    return Support(version, not why, why)


def main(argv: list[str]) -> int:
    if argv == ["--probe"]:
        applied = confine(Policy())
        print(json.dumps({"landlock_abi": applied.landlock_abi, "namespaces": applied.namespaces,
                          "why_not": applied.why_not}))
        return 0
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -I -m kiln.core.sandbox POLICY_JSON -- COMMAND...", file=sys.stderr)
        return 2
    policy = Policy.from_json(argv[0])
    confine(policy)
    if policy.cwd:
        os.chdir(policy.cwd)
    try:
        os.execvp(argv[2], argv[2:])
    except OSError as exc:
        print(f"kiln sandbox: cannot run {argv[2]}: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


__all__ = ["KEPT", "WHEELS_ONLY", "Policy", "Support", "confine", "credential_name", "guest_command", "guest_env",
           "guest_environ", "installer_command", "interpreter_trees", "kiln_trees", "local_sources", "seal_environ",
           "support", "wheels_only", "wheels_only_hint", "wrap"]
