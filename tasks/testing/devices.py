"""GPU device scheduling for test processes.

The runner needs to know how many devices exist without initialising CUDA in
its own process (a later fork would inherit a broken context), so detection
counts device nodes instead of asking a driver. ``KILN_GPU_COUNT`` overrides
detection: on a shared machine it caps what Kiln may use, and without a GPU
it lets the scheduling logic be tested.

Each test process sees only its devices through ``CUDA_VISIBLE_DEVICES`` and
``HIP_VISIBLE_DEVICES`` (both are set: each runtime ignores the other's), and
a process that needs no GPU sees none.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping
from pathlib import Path

from kiln.core.errors import InvalidInputError

COUNT_ENV = "KILN_GPU_COUNT"
VISIBLE_ENVS: tuple[str, ...] = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
_NVIDIA_NODE = re.compile(r"^nvidia[0-9]+$")
_KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")


def _count_nvidia(dev: Path) -> int:
    try:
        return sum(1 for p in dev.iterdir() if _NVIDIA_NODE.match(p.name))
    except OSError:
        return 0


def _count_amd(nodes: Path) -> int:
    """KFD topology nodes with a non-zero gpu_id are GPUs (CPU nodes have 0)."""
    count = 0
    try:
        for node in nodes.iterdir():
            gpu_id = (node / "gpu_id").read_text().strip() if (node / "gpu_id").exists() else "0"
            count += gpu_id not in ("", "0")
    except OSError:
        return 0
    return count


def parse_count(value: str, source: str = COUNT_ENV) -> int:
    try:
        count = int(value)
    except ValueError:
        raise InvalidInputError(f"{source}={value!r} is not a whole number of GPUs") from None
    if count < 0:
        raise InvalidInputError(f"{source}={value!r} must be 0 or more")
    return count


def detect_gpu_count(env: Mapping[str, str] | None = None, dev: Path = Path("/dev"), kfd: Path = _KFD_NODES) -> int:
    """Devices this runner may use: ``KILN_GPU_COUNT`` if set, else the device nodes found."""
    env = os.environ if env is None else env
    if env.get(COUNT_ENV, "").strip():
        return parse_count(env[COUNT_ENV].strip())
    return _count_nvidia(dev) + _count_amd(kfd)


def pin_env(devices: tuple[int, ...]) -> dict[str, str]:
    """Environment that makes exactly ``devices`` visible to a process (none for ``()``)."""
    value = ",".join(str(d) for d in devices)
    return {name: value for name in VISIBLE_ENVS}


class DevicePool:
    """Hands out disjoint device sets; never more than exist, never one twice."""

    def __init__(self, count: int) -> None:
        if count < 0:
            raise InvalidInputError(f"device count {count} must be 0 or more")
        self.count = count
        self._free = list(range(count))
        self._lock = threading.Lock()

    def fits(self, n: int) -> bool:
        return n <= self.count

    def acquire(self, n: int) -> tuple[int, ...] | None:
        """``n`` free devices (lowest ids first), or None when not enough are free now."""
        if n == 0:
            return ()
        with self._lock:
            if len(self._free) < n:
                return None
            taken, self._free = tuple(self._free[:n]), self._free[n:]
            return taken

    def release(self, devices: tuple[int, ...]) -> None:
        with self._lock:
            doubled = set(devices).intersection(self._free)
            if doubled:
                raise RuntimeError(f"devices {sorted(doubled)} released twice")  # a scheduler bug, not input
            self._free = sorted(self._free + list(devices))

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)


def skip_reason(needed: int, available: int) -> str | None:
    """Why a test cannot run here, or None when it can."""
    if needed <= available:
        return None
    return f"needs {needed} GPU{'s' if needed != 1 else ''}, {available} available"
