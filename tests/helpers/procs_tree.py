"""Is a process still running? (A zombie is dead: it only waits for init to reap it.)"""

from __future__ import annotations

import os
from pathlib import Path


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False  # gone between the two checks
    return state != "Z"
