"""The commands about indexes and wheels that need no Prefect server: index, verify, which and audit-abi."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.core.errors import EXIT_FAILED, EXIT_OK
from kiln.flows.cli.args import Commands, runs

if TYPE_CHECKING:
    from kiln.release.read.fetch import StoreSettings


def add_index(sub: Commands) -> None:
    p = sub.add_parser("index", help="generate a PEP 503/691 index (no Prefect needed)")
    p.add_argument("wheel_dir", nargs="?", help="directory of wheels to index")
    p.add_argument("--from-list", help="JSON lines: filename, sha256, size, upload_time, ...")
    p.add_argument("--out", required=True, help="output directory (this user's alone, 0700, unless --public)")
    p.add_argument("--public", action="store_true",
                   help="the output is served to others on purpose (another user's web server): readable by all,"
                        " and an existing directory others own or may write into is accepted")
    runs(p, _index_command)


def add_verify(sub: Commands) -> None:
    p = sub.add_parser("verify", help="check an index: links, hashes, sidecars; then install from it")
    p.add_argument("url", help="http(s):// (Kiln's server or any static server), file:///dir/ or s3://bucket/prefix/")
    p.add_argument("--no-install", action="store_true", help="only check links and hashes")
    p.add_argument("--extra-index-url", action="append", dest="extra_index_urls", default=[], metavar="URL",
                   help="resolve the package's dependencies from this index too (repeatable); fails when it "
                        "would win a name the index under test holds; without it the install uses --no-deps "
                        "(with the dependencies the index under test holds)")
    p.add_argument("--config", default="kiln.toml",
                   help="for s3:// URLs: the publish target settings (region, endpoint, owner) of that bucket")
    p.add_argument("--hint", action="append", dest="hints", default=[], metavar="'pip install ...'",
                   help="an install command a run printed: run it in a fresh venv, as a user would (each step "
                        "resolved first, not run when it would take a name this index holds from another index); "
                        "it must install the version this index publishes (repeatable)")
    runs(p, _verify_command)
    p.add_argument("--public-url", metavar="URL",
                   help="the CDN or web server in front of this index (standing for URL): every page and file "
                        "is downloaded through it too and must have the bytes the index says (a stale cache fails)")


def add_which(sub: Commands) -> None:
    p = sub.add_parser("which", help="the install command of the wheel on an index that fits an environment "
                                     "(default: this one), or why none fits")
    p.add_argument("url", help="the index: http(s)://, file:///dir/ or s3://bucket/prefix/")
    p.add_argument("--project", help="the project (default: the one the index holds besides kiln-runtime)")
    p.add_argument("--version", help="this version (default: the newest)")
    p.add_argument("--python", help="e.g. 3.12 (default: this interpreter)")
    p.add_argument("--platform", help="e.g. manylinux_2_28_x86_64 (default: this machine's)")
    p.add_argument("--torch", help="e.g. 2.14.1, or none (default: the installed torch's)")
    p.add_argument("--cuda", help="e.g. 13.0, or none (default: the installed torch's CUDA)")
    p.add_argument("--rocm", help="e.g. 6.4, or none (default: the installed torch's ROCm)")
    p.add_argument("--arch", help="GPU arch, e.g. 9.0 (default: the visible GPU's, if torch sees one)")
    p.add_argument("--extra-index-url", action="append", dest="extra_index_urls", default=[], metavar="URL",
                   help="where the dependencies the index does not hold come from (repeatable): the command then "
                        "has Kiln's two pip steps")
    runs(p, _which_command)


def add_audit_abi(sub: Commands) -> None:
    p = sub.add_parser("audit-abi", help="audit wheels' shared libraries: unstable torch symbols, the minimum torch, "
                                         "abi3 compliance of abi3-tagged wheels (exit 1: a wheel breaks its claim)")
    p.add_argument("wheels", nargs="+", metavar="WHEEL", help="a wheel file")
    p.add_argument("--stable", action="store_true",
                   help="the wheels claim the torch stable ABI (abi = \"stable\"): unstable torch symbols fail")
    runs(p, lambda ns: _audit_abi_command(ns.wheels, ns.stable))


def _index_command(ns: argparse.Namespace) -> int:
    from kiln.release.cli import index_command

    if bool(ns.wheel_dir) == bool(ns.from_list):
        raise SystemExit("kiln index: give exactly one of WHEEL_DIR or --from-list FILE")
    return index_command(ns.wheel_dir, ns.from_list, ns.out, ns.public)


def _store_settings(url: str, config_path: str) -> StoreSettings | None:
    """The publish target's settings for a remote store's URL (``s3://``; None for other URLs, or without a
    kiln.toml)."""
    from kiln.core.store import is_remote

    if not is_remote(url) or not Path(config_path).exists():
        return None
    from kiln.tasks.project.config import load_config
    from kiln.tasks.releasing import store_settings_for

    return store_settings_for(load_config(config_path), url)


def _verify_command(ns: argparse.Namespace) -> int:
    from kiln.release.cli import verify_command

    return verify_command(ns.url, install=not ns.no_install, extra_index_urls=ns.extra_index_urls,
                          settings=_store_settings(ns.url, ns.config), hints=ns.hints, public_url=ns.public_url)


def _which_command(ns: argparse.Namespace) -> int:
    from kiln.release.cli import which_command
    from kiln.release.which.environment import Asked

    asked = Asked(python=ns.python, platform=ns.platform, torch=ns.torch, cuda=ns.cuda, rocm=ns.rocm, arch=ns.arch)
    return which_command(ns.url, ns.project, ns.version, asked, ns.extra_index_urls)


def _audit_abi_command(wheels: list[str], stable: bool) -> int:
    from kiln.tasks.wheel.abi_audit import audit_wheel

    audits = [audit_wheel(Path(wheel), torch_stable=stable) for wheel in wheels]
    for audit in audits:
        print("\n".join(audit.lines()))
    return EXIT_FAILED if any(audit.findings() for audit in audits) else EXIT_OK
