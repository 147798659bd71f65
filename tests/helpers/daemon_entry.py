"""A command for Kiln's daemon to run in tests instead of ``kiln``: it reports what its process sees.

``echo CODE``: prints a JSON line of its pid, parent pid, cwd, argv, ``KILN_TEST_VALUE`` and the
stdin line it read, writes ``to stderr`` on stderr, returns ``CODE``. ``sleep PATH``: writes its
pid to PATH and sleeps (to be interrupted).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    if argv[0] == "sleep":
        Path(argv[1]).write_text(str(os.getpid()))
        time.sleep(600)
        return 0
    line = sys.stdin.readline().strip()
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(), "argv": sys.argv,
                      "value": os.environ.get("KILN_TEST_VALUE"), "stdin": line}))
    print("to stderr", file=sys.stderr)
    return int(argv[1])
