"""A compile-pool worker's main: ``python -P -m kiln.tasks.build.pool_worker FD STACKS``.

Started by :class:`kiln.tasks.build.pool.WorkerPool` with ``-P``, so the
directory the kiln command runs in is never on its import path while it
starts (``multiprocessing``'s spawn starts ``python -c``, which puts it
first: a ``socket.py`` planted there ran in every worker). Its import path
then becomes the parent's, received over the connection on file descriptor
``FD``, as ``multiprocessing``'s spawn does; the worker leads its own
process group from the start (``start_new_session``).
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection

from kiln.tasks.build.pool import serve


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[0].isdigit():
        print("usage: python -P -m kiln.tasks.build.pool_worker FD STACKS", file=sys.stderr)
        return 2
    serve(Connection(int(argv[0])), argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
