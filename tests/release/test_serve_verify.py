"""Serving an index like a CDN would, and verifying it from the outside (pip and uv installs)."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kiln.core.s3 import S3Store
from kiln.core.store import LocalStore
from kiln.release.index.render import JSON_TYPE
from kiln.release.publish.protocol import PublishRequest, PublishSteps, publish
from kiln.release.read.serve import IndexServer, wants_json
from kiln.release.read.verify import verify_index
from tests.helpers.runkit import make_run


def _get(url: str, accept: str | None = None) -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, response.headers["Content-Type"], response.read()


@pytest.mark.parametrize(
    ("accept", "json"),
    [
        (None, False),
        ("text/html", False),
        (JSON_TYPE, True),
        ("application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html; q=0.1, text/html; q=0.01", True),
        ("application/vnd.pypi.simple.v1+json; q=0.5, text/html", False),
        ("application/vnd.pypi.simple.latest+json", True),
        ("*/*", False),
    ],
)
def test_accept_negotiation_follows_pep691_qualities(accept: str | None, json: bool) -> None:
    assert wants_json(accept) is json


@pytest.fixture
def published(tmp_path: Path) -> LocalStore:
    run = make_run(tmp_path / "run", {"cu130": [("kiln-kernels", "0.1.0+cu130"), ("kiln-kernels", "0.2.0+cu130")]})
    store = LocalStore(tmp_path / "target")
    publish(run, store, PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cu130"]),
            PublishSteps(clock=lambda: 1.7e9))
    return store


def test_server_maps_directories_by_accept_and_decodes_plus_once(published: LocalStore) -> None:
    with IndexServer(published, "nightly/cu130/simple") as server:
        status, ctype, body = _get(server.url + "kiln-kernels/")
        assert status == 200 and ctype.startswith("text/html") and b"%2B" in body
        status, ctype, body = _get(server.url + "kiln-kernels/", JSON_TYPE)
        assert ctype == JSON_TYPE and body.startswith(b'{"files"')
        status, ctype, _ = _get(server.url + "kiln-kernels/kiln_kernels-0.1.0%2Bcu130-py3-none-any.whl")
        assert status == 200 and ctype == "application/octet-stream"
        status, _, body = _get(server.url + "kiln-kernels")  # redirected to kiln-kernels/
        assert status == 200 and b"Links for kiln-kernels" in body
        with pytest.raises(urllib.error.HTTPError) as missing:
            _get(server.url + "kiln-kernels/kiln_kernels-0.1.0 cu130-py3-none-any.whl".replace(" ", "%20"))
        assert missing.value.code == 404
        with pytest.raises(urllib.error.HTTPError) as escape:
            _get(server.url + "..%2F..%2Fetc/passwd")
        assert escape.value.code in (400, 404)


def test_verify_finds_a_missing_sidecar(published: LocalStore, tmp_path: Path) -> None:
    sidecar = tmp_path / "target/nightly/cu130/simple/kiln-kernels/kiln_kernels-0.2.0+cu130-py3-none-any.whl.metadata"
    sidecar.unlink()
    with IndexServer(published, "nightly/cu130/simple") as server:
        report = verify_index(server.url, install=False)
    assert not report.ok and any("metadata is advertised but does not resolve" in p for p in report.problems)


def test_verify_passes_a_published_index_without_install(published: LocalStore) -> None:
    with IndexServer(published, "nightly/cu130/simple") as server:
        report = verify_index(server.url, install=False)
    assert report.ok and report.files == 2 and report.pages == 4


@pytest.mark.slow
def test_pip_and_uv_install_the_newest_version_from_a_served_local_index(published: LocalStore) -> None:
    with IndexServer(published, "nightly/cu130/simple") as server:
        report = verify_index(server.url, install=True, timeout=240)
    assert report.ok, report.summary()
    assert set(report.installs) == {"pip kiln-kernels==0.2.0+cu130", "uv kiln-kernels==0.2.0+cu130"}


@pytest.mark.slow
def test_uv_installs_from_a_served_s3_prefix(tmp_path: Path, s3_store: S3Store) -> None:
    run = make_run(tmp_path / "run", {"cpu": [("demo-pkg", "1.0+cpu")]})
    publish(run, s3_store, PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cpu"]),
            PublishSteps(clock=lambda: 1.7e9))
    with IndexServer(s3_store, "nightly/cpu/simple") as server:
        report = verify_index(server.url, install=True, timeout=240, tools=("uv",))
    assert report.ok, report.summary()
    assert report.installs == {"uv demo-pkg==1.0+cpu": "ok"}


def test_verify_published_checks_every_variant_index_of_a_channel(tmp_path: Path) -> None:
    from kiln.core.errors import IntegrityError
    from kiln.release.read.verify import verify_published
    from kiln.tasks.project.config import load_config
    from kiln.tasks.releasing import channel_prefix, open_target

    (tmp_path / "src").mkdir()
    (tmp_path / "kiln.toml").write_text(
        '[project]\npackage = "demo_pkg"\ndistribution = "demo-pkg"\nversion = "1.0"\nsource = "src"\n'
        'registry = "demo.registry:registry"\n'
        '[[variants]]\nname = "cu130"\nbackend = "cuda"\narchs = ["9.0"]\n'
        '[[variants]]\nname = "cpu"\nbackend = "cpu"\narchs = []\n'
        '[publish]\ndefault_target = "local"\n[publish.targets.local]\nurl = "file://{out}/index"\n'
    )
    config = load_config(tmp_path / "kiln.toml")
    out = tmp_path / "out"
    run = make_run(out, {"cu130": [("demo-pkg", "1.0+cu130")], "cpu": [("demo-pkg", "1.0+cpu")]})
    publish(run, LocalStore(out / "index"),
            PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cu130", "cpu"]))
    store, prefix = open_target(config, str(out)), channel_prefix(config, "nightly")  # as the release flow opens it
    variants = [v.name for v in config.variants]
    reports = verify_published(store, prefix, variants, install=False)
    assert [r.files for r in reports] == [1, 1] and all(r.ok for r in reports)
    (out / "index/nightly/cpu/simple/demo-pkg/demo_pkg-1.0+cpu-py3-none-any.whl").write_bytes(b"x")
    with pytest.raises(IntegrityError, match="sha256 or size"):
        verify_published(store, prefix, variants, install=False)
