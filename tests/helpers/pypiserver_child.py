"""A real pypiserver on a loopback port the kernel picks; prints the port, then serves until killed.

Its request log (method, path, status) goes to stderr, which the test reads to
count what was sent. With ``KILN_TEST_PYPISERVER_TOKEN`` set, an upload needs that password (else any). No fallback to pypi.org: a name the server lacks is a 404.
"""

from __future__ import annotations

import os
import sys
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pypiserver

TOKEN_ENV = "KILN_TEST_PYPISERVER_TOKEN"  # the one password uploads are taken with, when set


class _Log(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        sys.stderr.write("request: " + (format % args) + "\n")
        sys.stderr.flush()


def main(root: str) -> None:
    token = os.environ.get(TOKEN_ENV)
    if token:  # uploads need this password: a test proves which token twine sent
        app = pypiserver.app(roots=[root], authenticate=["update"], auther=lambda _user, password: password == token,
                             disable_fallback=True)
    else:
        app = pypiserver.app(roots=[root], authenticate=[], password_file=".", disable_fallback=True)
    server = make_server("127.0.0.1", 0, app, handler_class=_Log)
    print(server.server_port, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1])
