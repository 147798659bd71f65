"""The run-time loader of the precompiled Triton artifacts a Kiln-built wheel ships.

Kiln's build stage writes ``<package>/_aot/manifest.json`` into every GPU
wheel: a JSON list of ``{kernel, entry, specialization, arch, kind, path,
sha256, toolchain, signature, constexprs, aligned}`` rows, ``path`` relative
to ``_aot/``, beside each binary Triton's metadata JSON. A package launches
its kernels through one :class:`Loader`::

    from kiln.runtime.loader import Loader

    AOT = Loader.beside(__file__)          # reads <this package>/_aot/

    def add(x, y):
        out = torch.empty_like(x)
        AOT.launch("add", "add_kernel", "fp32_b64", add_kernel, (triton.cdiv(x.numel(), 64),),
                   (x, y, out, x.numel()), {"BLOCK": 64}, x.device)
        return out

For the device a call runs on, the loader picks the best artifact (CUDA: the
exact arch, else the highest lower minor of the same major, never an
``a``/``f`` build of another arch; ROCm: the exact gfx target), checks its
sha256 against the manifest and the Triton version that built it against
the one installed, and launches it; otherwise — no manifest (a source
checkout), no artifact for this device, a hash or version mismatch, the CPU,
the Triton interpreter, arguments that break the artifact's alignment
assumptions — it runs Triton's JIT, warning once per kernel. Nothing here
imports torch or Triton until a kernel is launched.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from kiln.runtime.archs import cuda_arch_key

MANIFEST = "manifest.json"
KINDS = {"cuda": "cubin", "hip": "hsaco"}
_KEYS = ("kernel", "entry", "specialization", "arch", "kind", "path", "sha256")
_TRUE = frozenset({"1", "true", "yes", "on"})
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Device:
    """What artifacts are matched against: ``backend`` (``cuda``/``hip``/``cpu``), its arch
    (``"9.0"``, ``"gfx942"``, ``""``), whether Triton runs interpreted, and Triton's version."""

    backend: str
    arch: str = ""
    triton: str | None = None
    interpreter: bool = False


@dataclass(frozen=True)
class Artifact:
    kernel: str
    entry: str
    specialization: str
    arch: str
    kind: str  # "cubin" | "hsaco"
    path: Path  # absolute
    sha256: str
    triton: str | None = None  # the Triton that built it, when the manifest says
    # What rebuilding a launchable kernel needs (Kiln writes them; None: only the JIT can run it).
    signature: Mapping[str, str] | None = None
    constexprs: Mapping[str, Any] = field(default_factory=dict)
    aligned: tuple[str, ...] = ()


# Any: the parsed JSON manifest, checked here
def parse_manifest(data: Any, root: Path) -> tuple[Artifact, ...]:
    """Validate a decoded manifest (``ValueError`` naming the entry); paths must stay inside ``root``."""
    if not isinstance(data, list):
        raise ValueError("AOT manifest must be a JSON list of entries")
    out = []
    for i, entry in enumerate(data):
        missing = [k for k in _KEYS if not isinstance(entry, dict) or not isinstance(entry.get(k), str)]
        if missing:
            raise ValueError(f"AOT manifest entry {i}: missing or non-string {missing}")
        path = (root / entry["path"]).resolve()
        if not path.is_relative_to(root.resolve()):
            raise ValueError(f"AOT manifest entry {i}: path {entry['path']!r} leaves {root}")
        if entry["kind"] not in KINDS.values():
            continue  # a shared library or another file the loader does not launch
        toolchain = entry.get("toolchain") if isinstance(entry.get("toolchain"), dict) else {}
        signature = entry.get("signature")
        out.append(Artifact(**{k: entry[k] for k in _KEYS if k != "path"}, path=path, triton=toolchain.get("triton"),
                            signature=signature if isinstance(signature, dict) else None,
                            constexprs=entry.get("constexprs") or {}, aligned=tuple(entry.get("aligned") or ())))
    return tuple(out)


def read_manifest(root: Path) -> tuple[Artifact, ...]:
    """The artifacts listed under ``root``; none when there is no manifest (a source checkout)."""
    file = Path(root) / MANIFEST
    if not file.is_file():
        return ()
    return parse_manifest(json.loads(file.read_text()), Path(root))


def arch_rank(device: Device, arch: str) -> tuple[int, int] | None:
    """How well an artifact built for ``arch`` fits ``device``; ``None`` when it cannot run there."""
    if device.backend == "hip":
        return (0, 0) if arch == device.arch else None
    if device.backend != "cuda":
        return None
    want, have = cuda_arch_key(device.arch), cuda_arch_key(arch)
    if have == want:
        return (1, 0 if arch.endswith(("a", "f")) else 1)
    if have[0] == want[0] and have[1] < want[1] and not arch.endswith(("a", "f")):
        return (0, have[1])
    return None


def find_artifact(artifacts: Sequence[Artifact], kernel: str, entry: str, specialization: str,
                  device: Device) -> Artifact | None:
    """The best artifact for ``device``, or ``None`` (pure)."""
    kind = KINDS.get(device.backend)
    best: tuple[tuple[int, int], Artifact] | None = None
    for art in artifacts:
        if (art.kernel, art.entry, art.specialization, art.kind) != (kernel, entry, specialization, kind):
            continue
        rank = arch_rank(device, art.arch)
        if rank is not None and (best is None or rank > best[0]):
            best = (rank, art)
    return None if best is None else best[1]


class InterpreterModeError(RuntimeError):
    """``TRITON_INTERPRET=1`` was set after a kernel's module was imported: it cannot run interpreted."""


class Precompiled(NamedTuple):
    """A launchable artifact and the argument positions it assumes divisible by 16."""

    kernel: Any  # triton CompiledKernel
    aligned: tuple[int, ...]


def triton_version() -> str | None:
    """The installed Triton's version, or None without Triton (imported only when asked)."""
    try:
        import triton
    except ImportError:
        return None
    return str(triton.__version__)


@functools.cache
def _device_of(kind: str, index: int | None) -> Device:
    interpreter = os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE
    if kind != "cuda":
        return Device("cpu", "", triton_version(), interpreter)
    import torch

    props = torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device())
    if torch.version.hip:
        return Device("hip", props.gcnArchName.split(":")[0], triton_version(), interpreter)
    return Device("cuda", f"{props.major}.{props.minor}", triton_version(), interpreter)


# Any: a torch or Triton object: kiln-runtime depends on neither
def device_of(device: Any = None) -> Device:
    """The :class:`Device` of a torch device (default: the current CUDA device, else the CPU); cached."""
    if isinstance(device, Device):
        return device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = str(device).partition(":")
    return _device_of(kind, int(index) if index else None)


def reset_devices() -> None:
    """Forget cached devices (after changing ``TRITON_INTERPRET`` or the visible GPUs)."""
    _device_of.cache_clear()


def divisible_by_16(args: Sequence[Any], positions: Sequence[int]) -> bool:
    """Whether the arguments at ``positions`` meet an artifact's alignment assumptions
    (a tensor's data pointer, an int's value). Host metadata only: no device sync."""
    for i in positions:
        value = args[i].data_ptr() if hasattr(args[i], "data_ptr") else args[i]
        if value % 16:
            return False
    return True


_rebuilt: dict[int, Any] = {}


# Any: a torch or Triton object: kiln-runtime depends on neither
def runnable(fn: Any, interpreter: bool) -> Any:
    """``fn`` (a ``@triton.jit`` function) in the form this mode runs.

    ``@triton.jit`` picks JIT or interpreter once, when its module is imported;
    a kernel imported in interpreter mode is rebuilt as a real ``JITFunction``
    for a GPU. The other way round cannot be done (the interpreter re-reads the
    kernel from its module), so that is a clear error."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if isinstance(fn, InterpretedFunction) == interpreter:
        return fn
    if interpreter:
        raise InterpreterModeError(f"{fn.__name__}: TRITON_INTERPRET=1 was set after the kernel's module was imported; "
                           "set it before importing the kernels and restart")
    if id(fn) not in _rebuilt:
        _rebuilt[id(fn)] = JITFunction(fn.fn)
    return _rebuilt[id(fn)]


# Any: a torch or Triton object: kiln-runtime depends on neither
def load_compiled(fn: Any, art: Artifact) -> Any:
    """A launchable ``CompiledKernel`` from a verified artifact and Triton's metadata beside it."""
    from triton.compiler import ASTSource
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.jit import JITFunction

    jit = fn if isinstance(fn, JITFunction) else JITFunction(fn.fn)
    names = list(jit.arg_names)
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in art.aligned}
    source = ASTSource(fn=jit, signature=dict(art.signature or {}), constexprs=dict(art.constexprs), attrs=attrs)
    meta = art.path.with_suffix(".json")
    if not meta.is_file():
        raise FileNotFoundError(f"{meta}: Triton metadata for {art.path.name} is missing")
    return CompiledKernel(source, {art.path.name: str(art.path), meta.name: str(meta)}, art.sha256)


class Loader:
    """One package's precompiled artifacts (``root``: its ``_aot`` directory)."""

    def __init__(self, root: Path | str) -> None:
        self._root = Path(root)
        self._lock = threading.Lock()
        self._artifacts: tuple[Artifact, ...] | None = None
        self._compiled: dict[tuple[str, str, str, Device], Precompiled | None] = {}
        self._warned: set[str] = set()

    @classmethod
    def beside(cls, module_file: str) -> Loader:
        """The loader of the package whose module file is ``module_file`` (its ``_aot/`` directory)."""
        return cls(Path(module_file).resolve().parent / "_aot")

    @property
    def root(self) -> Path:
        return self._root

    def use_root(self, root: Path | str) -> None:
        """Read artifacts from ``root`` from now on (a self check's scratch build), forgetting what was loaded."""
        with self._lock:
            self._root, self._artifacts = Path(root), None
            self._compiled.clear()
            self._warned.clear()

    @property
    def artifacts(self) -> tuple[Artifact, ...]:
        if self._artifacts is None:
            self._artifacts = read_manifest(self._root)
        return self._artifacts

    def loaded(self, kernel: str, entry: str, specialization: str, device: Device) -> bool:
        """Whether a precompiled artifact (not the JIT) serves this key."""
        return self._compiled.get((kernel, entry, specialization, device)) is not None

    # Any: the logging call's own arguments, passed on
    def _warn_once(self, kernel: str, message: str, *args: Any) -> None:
        if kernel not in self._warned:
            self._warned.add(kernel)
            _log.warning(message, *args)

    # Any: a torch or Triton object: kiln-runtime depends on neither
    def precompiled(self, kernel: str, entry: str, specialization: str, fn: Any, device: Device) -> Precompiled | None:
        """A launchable precompiled kernel for ``device``, or ``None`` (then the caller JITs).

        Resolved once per key; a binary whose hash differs from the manifest is never launched."""
        key = (kernel, entry, specialization, device)
        if key in self._compiled:
            return self._compiled[key]
        with self._lock:
            art = find_artifact(self.artifacts, kernel, entry, specialization, device)
            result = None
            if art is None:
                self._warn_once(kernel, "%s: no precompiled %s for %s %s in %s; using Triton JIT",
                                kernel, specialization, device.backend, device.arch, self._root)
            elif art.triton is not None and art.triton != device.triton:
                # A Triton binary's calling convention belongs to the Triton that built it.
                self._warn_once(kernel, "%s: artifacts were built with Triton %s, this is Triton %s; using Triton JIT",
                                kernel, art.triton, device.triton)
            elif art.signature is None:
                self._warn_once(
                    kernel, "%s: the manifest gives no signature for %s; using Triton JIT", kernel, art.path
                )
            elif not art.path.is_file():
                self._warn_once(
                    kernel, "%s: %s is listed in the manifest but missing; using Triton JIT", kernel, art.path
                )
            elif hashlib.sha256(art.path.read_bytes()).hexdigest() != art.sha256:
                self._warn_once(kernel, "%s: %s does not match its manifest sha256; using Triton JIT", kernel, art.path)
            else:
                names = list(getattr(fn, "arg_names", ()))
                result = Precompiled(load_compiled(fn, art), tuple(names.index(p) for p in art.aligned))
            self._compiled[key] = result
        return result

    # Any: a torch or Triton object: kiln-runtime depends on neither
    def launch(self, kernel: str, entry: str, specialization: str, fn: Any, grid: Sequence[int], args: Sequence[Any],
        # Any: a torch or Triton object: kiln-runtime depends on neither
               constexprs: Mapping[str, Any], device: Any = None, **options: Any) -> None:
        """Run ``fn[grid](*args, **constexprs, **options)``, from the shipped artifact when one fits.

        ``constexprs`` must list the kernel's constexpr parameters in signature
        order, after every runtime argument in ``args``: a precompiled kernel
        takes every argument positionally."""
        target = device_of(device)
        pre = None
        if target.backend in KINDS and not target.interpreter:
            pre = self.precompiled(kernel, entry, specialization, fn, target)
        if pre is not None and divisible_by_16(args, pre.aligned):
            grid3 = tuple(grid) + (1,) * (3 - len(grid))
            pre.kernel[grid3](*args, *constexprs.values())
            return
        runnable(fn, target.interpreter)[tuple(grid)](*args, **constexprs, **options)
