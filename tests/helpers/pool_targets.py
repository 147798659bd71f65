"""Functions the compile-pool tests run inside real workers (imported there by ``module:function``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kiln.core.errors import CompileError


class FixtureCompileError(CompileError):
    """A KilnError subclass only this module defines: it must arrive as itself."""


class TwoArgError(Exception):
    """Pickles, but cannot be unpickled: its __init__ wants two arguments and args holds one."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what} failed: {why}")


def noop(request: Any) -> Any:
    return request


def raise_fixture_error(request: Any) -> None:
    raise FixtureCompileError(f"fixture compile failure for {request}")


def raise_unpicklable(request: Any) -> None:
    raise TwoArgError("the fixture", str(request))


def compile_with_triton_missing(request: dict[str, Any]) -> Any:
    """Fault injection: the real compile_in_worker, in a worker where ``import triton`` fails."""
    from kiln.tasks.build.aot import compile_in_worker

    saved = {n: m for n, m in sys.modules.items() if n == "triton" or n.startswith("triton.")}
    for name in saved:
        del sys.modules[name]
    sys.modules["triton"] = None  # type: ignore[assignment]  # makes `import triton` raise ImportError
    try:
        return compile_in_worker(request)
    finally:
        del sys.modules["triton"]
        sys.modules.update(saved)


def hang_in_named_frame(request: Any) -> None:
    while True:
        time.sleep(0.05)


def hang_ignoring_sigterm(request: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    hang_in_named_frame(request)


def hang_with_a_compiler_child(pid_file: str) -> None:
    """Starts a long-lived subprocess (as ptxas would be) in the worker's group, then hangs."""
    child = subprocess.Popen(["sleep", "600"])
    Path(pid_file + ".tmp").write_text(str(child.pid))
    os.replace(pid_file + ".tmp", pid_file)  # the test reads it whole or not at all
    hang_in_named_frame(None)


def imported_from(module: str) -> str:
    """Where the worker imports ``module`` from."""
    import importlib

    return str(importlib.import_module(module).__file__)


def environ(name: str) -> str | None:
    return os.environ.get(name)
