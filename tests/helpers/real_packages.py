"""Real public packages, fetched at test time as published (pins in tests/fixtures/real_packages.toml).

:func:`fetch_sdist` downloads the pinned source distribution with pip (the
machine's configured indexes), refuses it unless its sha256 is the pinned one,
and unpacks it without links, devices or ownership; :func:`committed_checkout`
commits it in a fresh git repository, since Kiln builds from git.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.helpers.gitrepo import commit_all, git

PINS = Path(__file__).resolve().parents[1] / "fixtures" / "real_packages.toml"
KINDS = ("triton-jit", "pep517")
DOWNLOAD_TIMEOUT_S = 600
PYPI_SIMPLE = "https://pypi.org/simple"  # PEP 691 JSON: the files of a project, each with its sha256
_ATTEMPTS = 3


class PinError(Exception):
    """tests/fixtures/real_packages.toml is malformed, or a download does not match its pin."""


@dataclass(frozen=True)
class RealPackage:
    name: str
    kind: str
    version: str
    sdist: str
    sha256: str
    import_name: str
    # What `kiln init` must infer beyond the sdist's own PKG-INFO (the corpus test): its variants, in order,
    # and the build switches its GPU variant needs.
    variants: tuple[str, ...] = ()
    build_env: dict[str, str] = field(default_factory=dict)
    # The build switches of its CPU (or pure-Python) variants, and variables its build reads that kiln init must
    # name in its "also read" comment, each with what it controls (from the package's own build files).
    cpu_build_env: dict[str, str] = field(default_factory=dict)
    also_read: dict[str, str] = field(default_factory=dict)


def load_pin(name: str, path: Path = PINS) -> RealPackage:
    """The pin of ``name``, validated: a PEP 440 version, a 64-hex sha256, an sdist named for both."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    if name not in data:
        raise PinError(f"{path} pins no {name!r}; it pins {sorted(data)}")
    entry = data[name]
    fields = {"kind", "version", "sdist", "sha256", "import_name"}
    optional = {"variants", "build_env", "cpu_build_env", "also_read"}
    if not fields <= set(entry) <= fields | optional:
        raise PinError(f"{path} [{name}]: keys {sorted(entry)}, expected {sorted(fields)} (and {sorted(optional)})")
    pin = RealPackage(name, **(entry | {"variants": tuple(entry.get("variants", ()))}))
    if pin.kind not in KINDS:
        raise PinError(f"{path} [{name}]: kind {pin.kind!r} is not one of {KINDS}")
    if len(pin.sha256) != 64 or any(c not in "0123456789abcdef" for c in pin.sha256):
        raise PinError(f"{path} [{name}]: sha256 {pin.sha256!r} is not 64 lowercase hex digits")
    stem = f"{canonicalize_name(name).replace('-', '_')}-{Version(pin.version)}"
    if pin.sdist != f"{stem}.tar.gz":
        raise PinError(f"{path} [{name}]: sdist {pin.sdist!r} is not {stem}.tar.gz")
    return pin


def fetch_sdist(pin: RealPackage, dest: Path, python: Path | str = sys.executable) -> Path:
    """Download the pinned sdist into ``dest``, check its sha256, unpack it; return the unpacked directory.

    pip reads the sdist's metadata with ``python``'s packages (no build isolation): a torch extension whose
    setup.py makes a ``CUDAExtension`` wherever nvcc is found needs a CUDA torch's ``python`` for that."""
    dest.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([str(python), "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                           "--no-build-isolation", "--dest", str(dest), f"{pin.name}=={pin.version}"],
                          capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, cwd=dest)
    archive = dest / pin.sdist
    if done.returncode != 0 or not archive.is_file():
        raise PinError(f"pip could not download {pin.sdist} (exit {done.returncode}):\n{done.stderr[-2000:]}")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != pin.sha256:
        raise PinError(f"{pin.sdist} has sha256 {digest}, pinned {pin.sha256}: refusing a changed package")
    with tarfile.open(archive) as tar:
        tar.extractall(dest / "unpacked", filter="data")  # no links out, no devices, no ownership
    return dest / "unpacked" / pin.sdist.removesuffix(".tar.gz")


def pinned_names(path: Path = PINS) -> list[str]:
    return sorted(tomllib.loads(path.read_text(encoding="utf-8")))


def _get(url: str, accept: str = "*/*") -> bytes:
    """``url``'s body, with a deadline and a bounded retry of connection faults (never of an HTTP answer)."""
    request = urllib.request.Request(url, headers={"Accept": accept})
    for attempt in range(1, _ATTEMPTS + 1):
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return bytes(response.read())
        except urllib.error.HTTPError as exc:
            raise PinError(f"{url}: HTTP {exc.code}") from exc
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            if attempt == _ATTEMPTS:
                raise PinError(f"{url}: {exc} ({attempt} attempts)") from exc
            time.sleep(2 * attempt)  # a back-off between attempts, not a wait for a condition
    raise AssertionError("unreachable")


def download_sdist(pin: RealPackage, dest: Path, index: str = PYPI_SIMPLE) -> Path:
    """The pinned sdist from ``index``'s PEP 691 page, checked and unpacked, without running any of its code
    (``pip download`` prepares metadata: a CUDA-only setup.py refuses that on a machine without CUDA)."""
    page = json.loads(_get(f"{index}/{canonicalize_name(pin.name)}/", "application/vnd.pypi.simple.v1+json"))
    url = next((f["url"] for f in page.get("files", []) if f.get("filename") == pin.sdist), None)
    if url is None:
        raise PinError(f"{index} lists no {pin.sdist}")
    data = _get(url)
    digest = hashlib.sha256(data).hexdigest()
    if digest != pin.sha256:
        raise PinError(f"{pin.sdist} has sha256 {digest}, pinned {pin.sha256}: refusing a changed package")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / pin.sdist).write_bytes(data)
    with tarfile.open(dest / pin.sdist) as tar:
        tar.extractall(dest / "unpacked", filter="data")  # no links out, no devices, no ownership
    return dest / "unpacked" / pin.sdist.removesuffix(".tar.gz")


def committed_checkout(source: Path) -> Path:
    """``source`` committed as it is in a fresh git repository (Kiln's nightly publishes only a clean commit)."""
    git(source, "init", "-q", "-b", "main")
    commit_all(source, "the package as published")
    return source
