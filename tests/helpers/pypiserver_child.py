"""A real pypiserver on a loopback port the kernel picks; prints the port, then serves until killed.

Its request log (method, path, status) goes to stderr, which the test reads to
count what was sent. No fallback to pypi.org: a name the server lacks is a 404.
"""

from __future__ import annotations

import sys
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pypiserver


class _Log(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        sys.stderr.write("request: " + (format % args) + "\n")
        sys.stderr.flush()


def main(root: str) -> None:
    app = pypiserver.app(roots=[root], authenticate=[], password_file=".", disable_fallback=True)
    server = make_server("127.0.0.1", 0, app, handler_class=_Log)
    print(server.server_port, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1])
