"""The environment every installer and resolver subprocess Kiln starts runs with.

pip and uv read an index's pages, and a resolver may run code it fetched (an
sdist's PEP 517 hook, a ``.pth`` of a wheel it installs): what that code can
read is what :func:`scrubbed_env` leaves. It keeps what an installer needs to
reach its indexes — ``PATH``, the locale, proxy variables, the installer's
own configuration (``PIP_*``, ``UV_*``: a mirror, a certificate, a trusted
host), certificate bundles — and drops the rest: cloud credentials (``AWS_*``
and the like), Prefect's home and API key, Kiln's own settings. Of the
installers' variables it drops those that add an index behind the ones Kiln
names (``PIP_EXTRA_INDEX_URL``, ``UV_INDEX``…) or change uv's first-index
strategy, and uv's publish credentials. ``HOME`` points at a directory of the caller's, so no
``~/.aws``, ``~/.netrc`` or ``~/.config`` of the user running Kiln is read;
``/etc/pip.conf`` and ``/etc/uv/uv.toml`` still apply.

The rule is a short allow-list, not a deny-list: a secret under a name
nobody thought of is dropped too.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

KEPT = frozenset({
    "PATH", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "no_proxy", "all_proxy",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NIX_SSL_CERT_FILE",
})
KEPT_PREFIXES = ("LC_", "PIP_", "UV_")
# an installer's own variables that would hand it a secret, or add an index (or change uv's first-index strategy)
# behind the indexes Kiln names on the command line: a step meant to read the Kiln index alone must do so
DROPPED = frozenset({"UV_PUBLISH_TOKEN", "UV_PUBLISH_PASSWORD", "UV_PUBLISH_USERNAME",
                     "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "UV_EXTRA_INDEX_URL", "UV_INDEX", "UV_FIND_LINKS",
                     "UV_INDEX_STRATEGY"})


def scrubbed_env(home: Path, source: Mapping[str, str] | None = None,
                 extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """What an installer subprocess sees: the kept variables of ``source`` (default: this process's),
    ``HOME`` = ``home`` (and no XDG directories of the user's), then ``extra``."""
    env = os.environ if source is None else source
    kept = {key: value for key, value in env.items()
            if (key in KEPT or key.startswith(KEPT_PREFIXES)) and key not in DROPPED}
    return {**kept, "HOME": str(home), "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1", **(extra or {})}


def user_cache(tool: str, variable: str) -> str:
    """The installer's cache of the user running Kiln (``$variable``, else ``$XDG_CACHE_HOME/tool`` or
    ``~/.cache/tool``): named explicitly to an installer whose ``HOME`` is a private one, so it stays warm."""
    return os.environ.get(variable) or str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / tool)


def resolver_env(home: Path) -> dict[str, str]:
    """What a ``uv pip compile`` that checks whether requirements can be had runs with: :func:`scrubbed_env`
    (``HOME`` = ``home``), uv's cache of the user kept warm, and no interpreter downloaded. The machine's own
    pip sources reach it as options (:func:`kiln.tasks.build.buildenv.uv_source_options`), not variables."""
    return scrubbed_env(home, extra={"UV_CACHE_DIR": user_cache("uv", "UV_CACHE_DIR"), "UV_PYTHON_DOWNLOADS": "never"})


def run_installer(cmd: Sequence[str], cwd: Path, timeout: float, extra_env: Mapping[str, str] | None = None,
                  unset: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """Run one installer or resolver command in ``cwd`` with :func:`scrubbed_env` (``HOME`` = a fresh
    ``cwd/home``) less the names ``unset`` (a hint's ``env -u``), its output captured; raises
    :class:`subprocess.TimeoutExpired` or :class:`OSError` as :func:`subprocess.run` does (each caller words
    its own failure)."""
    home = Path(cwd) / ".kiln-home"
    home.mkdir(mode=0o700, exist_ok=True)
    log.info("running %s (in %s, scrubbed environment)", shlex.join(cmd), cwd)
    env = {name: value for name, value in scrubbed_env(home, extra=extra_env).items() if name not in unset}
    return subprocess.run(list(cmd), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env)


__all__ = ["KEPT", "KEPT_PREFIXES", "resolver_env", "run_installer", "scrubbed_env", "user_cache"]
