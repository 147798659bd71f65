"""A command for Kiln's daemon to run in tests instead of ``kiln``: it reports what its process sees.

``echo CODE``: prints a JSON line of its pid, parent pid, cwd, argv, ``KILN_TEST_VALUE`` and the
stdin line it read, writes ``to stderr`` on stderr, returns ``CODE``. ``limits``: prints a JSON line
of its umask and resource limits. ``sleep PATH``: starts a ``sleep`` in its process group, writes
its pid to PATH and sleeps (to be interrupted). ``block PATH``: the same, ignoring SIGTERM, SIGINT
and SIGHUP (a command that does not end when asked).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path


def _wait_in_group(marker: str, ignore: bool) -> int:
    if ignore:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
    # A process of the command's group that is not the command: it must end with the group.
    helper = subprocess.Popen(["sleep", "600"])
    Path(marker).write_text(str(os.getpid()))
    try:
        time.sleep(600)
    finally:
        helper.kill()
        helper.wait(timeout=60)
    return 0


def main(argv: list[str]) -> int:
    if argv[0] in ("sleep", "block"):
        return _wait_in_group(argv[1], ignore=argv[0] == "block")
    if argv[0] == "limits":
        mask = os.umask(0)
        limits = {name: resource.getrlimit(getattr(resource, name)) for name in ("RLIMIT_NOFILE", "RLIMIT_CORE")}
        print(json.dumps({"umask": mask, **limits}))
        return 0
    line = sys.stdin.readline().strip()
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(), "argv": sys.argv,
                      "value": os.environ.get("KILN_TEST_VALUE"), "stdin": line}))
    print("to stderr", file=sys.stderr)
    return int(argv[1])
