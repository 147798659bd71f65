"""``kiln verify`` on every URL Kiln prints: file://, plain static servers, s3://; dependencies from extra indexes.

Real parts throughout: ``python -m http.server`` as a subprocess, moto's S3
server on loopback, real pip and uv installing from local indexes (never the
internet).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from kiln.core.fsutil import sha256_file
from kiln.core.s3 import S3Store
from kiln.core.store import LocalStore
from kiln.flows.cli import main
from kiln.release.cli import EXIT_OK, EXIT_USAGE, index_command
from kiln.release.install.installer import index_options
from kiln.release.publish.protocol import PublishRequest, PublishSteps, publish
from kiln.release.read.fetch import StoreSettings
from kiln.release.read.serve import IndexServer
from kiln.release.read.verify import verify_index
from tests.helpers.runkit import make_run
from tests.helpers.staticserver import static_server
from tests.helpers.wheelkit import make_wheel

WHEEL = "alpha-1.1+cu130-py3-none-any.whl"


def _index(tmp_path: Path, wheels: list[dict[str, Any]], name: str = "idx") -> Path:
    """``kiln index`` over freshly made wheels: ``[{"name": ..., "version": ..., **make_wheel kwargs}]``."""
    for wheel in wheels:
        make_wheel(tmp_path / f"{name}-wheels", **wheel)
    assert index_command(str(tmp_path / f"{name}-wheels"), None, str(tmp_path / name)) == EXIT_OK
    return tmp_path / name


@pytest.fixture
def alpha(tmp_path: Path) -> Path:
    return _index(tmp_path, [{"name": "alpha", "version": "1.0+cu130"}, {"name": "alpha", "version": "1.1+cu130"}])


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_file_index_is_read_from_disk_in_both_forms(alpha: Path) -> None:
    report = verify_index(alpha.as_uri() + "/", install=False)
    assert report.ok, report.summary()
    assert (report.pages, report.files) == (4, 2)


def test_a_file_url_without_the_trailing_slash_is_the_same_index(alpha: Path) -> None:
    report = verify_index(alpha.as_uri(), install=False)
    assert report.ok and report.url == alpha.as_uri() + "/", report.summary()


def test_a_file_url_that_is_not_a_directory_is_refused_naming_it(alpha: Path, capsys) -> None:
    assert main(["verify", (alpha / "index.html").as_uri(), "--no-install"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "index.html is not a directory" in err and (alpha / "index.html").as_uri() in err


def test_a_plain_static_server_is_checked_in_both_forms_and_the_report_says_how(alpha: Path) -> None:
    with static_server(alpha) as url:
        report = verify_index(url, install=False)
    assert report.ok, report.summary()
    assert (report.pages, report.files) == (4, 2)
    assert any("no PEP 691 content negotiation" in note for note in report.notes)


def test_a_static_mirror_without_json_is_checked_from_html_alone_and_says_so(alpha: Path) -> None:
    for page in alpha.rglob("index.json"):
        page.unlink()
    with static_server(alpha) as url:
        report = verify_index(url, install=False)
        assert report.ok, report.summary()
        assert (report.pages, report.files) == (2, 2)
        assert any("2 page(s) have no PEP 691 JSON form" in note for note in report.notes), report.notes
        wheel = alpha / "alpha" / WHEEL
        advertised = sha256_file(wheel)
        wheel.write_bytes(b"tampered")
        report = verify_index(url, install=False)
    problems = [p for p in report.problems if WHEEL in p]
    assert problems and advertised in problems[0] and _sha256(b"tampered") in problems[0], report.problems


def test_a_tampered_wheel_on_a_static_server_is_named_with_both_hashes(alpha: Path, capsys) -> None:
    wheel = alpha / "alpha" / WHEEL
    advertised = sha256_file(wheel)
    wheel.write_bytes(b"tampered")
    with static_server(alpha) as url:
        assert main(["verify", url, "--no-install"]) != EXIT_OK
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "problem:" in line and WHEEL in line]
    assert lines, out
    assert all(advertised in line and _sha256(b"tampered") in line for line in lines), lines
    assert {"the HTML page", "the JSON page"} <= {form for line in lines for form in ("the HTML page", "the JSON page")
                                                  if form in line}


def test_a_tampered_sidecar_on_a_static_server_is_named_with_both_hashes(alpha: Path) -> None:
    sidecar = alpha / "alpha" / f"{WHEEL}.metadata"
    advertised = sha256_file(sidecar)
    sidecar.write_bytes(b"Metadata-Version: 2.1\nName: alpha\nVersion: 6.6.6\n")
    with static_server(alpha) as url:
        report = verify_index(url, install=False)
    problems = [p for p in report.problems if f"{WHEEL}.metadata" in p]
    assert problems, report.summary()
    assert all(advertised in p and sha256_file(sidecar) in p for p in problems), problems


def test_pip_gets_every_extra_index_and_uv_ranks_the_index_under_test_first() -> None:
    assert index_options("pip", "A", ["B", "C"]) == ["--index-url", "A", "--extra-index-url", "B",
                                                     "--extra-index-url", "C"]
    assert index_options("uv", "A", ["B", "C"]) == ["--index-strategy", "first-index", "--index", "A", "--index", "B",
                                                    "--default-index", "C"]
    assert index_options("uv", "A") == ["--default-index", "A"]


@pytest.mark.slow
def test_kiln_verify_installs_from_a_file_index(alpha: Path, capsys) -> None:
    assert main(["verify", alpha.as_uri()]) == EXIT_OK
    out = capsys.readouterr().out
    assert "install pip alpha==1.1+cu130: ok" in out and "install uv alpha==1.1+cu130: ok" in out, out
    assert "dependencies were not resolved" in out


@pytest.mark.slow
def test_kiln_verify_installs_from_a_plain_static_server(alpha: Path, capsys) -> None:
    with static_server(alpha) as url:
        assert main(["verify", url]) == EXIT_OK
    out = capsys.readouterr().out
    assert "install pip alpha==1.1+cu130: ok" in out and "install uv alpha==1.1+cu130: ok" in out, out


def _app_and_dep(tmp_path: Path) -> tuple[Path, Path]:
    """An index holding ``app`` (which imports ``dep``), and another holding ``dep`` — and an impostor ``app``.

    The impostor proves that the index under test wins for its own project: uv takes a project from the
    first index that has it, so with the extra index ranked first it would find only app 9.0 and fail.
    """
    app = _index(tmp_path, [{"name": "app", "version": "1.0", "requires": ["dep>=2"],
                             "body": "from dep import VALUE\n"}], name="app-index")
    deps = _index(tmp_path, [{"name": "dep", "version": "1.0", "body": "VALUE = 1\n"},
                             {"name": "dep", "version": "2.0", "body": "VALUE = 2\n"},
                             {"name": "app", "version": "9.0"}], name="dep-index")
    return app, deps


@pytest.mark.slow
def test_extra_index_url_resolves_a_dependency_that_only_the_extra_index_holds(tmp_path: Path, capsys) -> None:
    app, deps = _app_and_dep(tmp_path)
    with static_server(deps) as extra:
        assert main(["verify", app.as_uri(), "--extra-index-url", extra]) == EXIT_OK
    out = capsys.readouterr().out
    assert "install pip app==1.0: ok" in out and "install uv app==1.0: ok" in out, out
    assert f"dependencies resolved from {extra}" in out


@pytest.mark.slow
def test_without_an_extra_index_the_dependency_is_not_resolved_and_the_report_says_so(tmp_path: Path) -> None:
    app, _ = _app_and_dep(tmp_path)
    report = verify_index(app.as_uri())
    assert not report.ok and all("No module named 'dep'" in v for v in report.installs.values()), report.summary()
    assert any("dependencies were not resolved" in note for note in report.notes)


def _s3_config(tmp_path: Path, bucket: str, endpoint: str) -> Path:
    (tmp_path / "src").mkdir()
    config = tmp_path / "kiln.toml"
    config.write_text(
        '[project]\npackage = "demo_pkg"\ndistribution = "demo-pkg"\nversion = "1.0"\nsource = "src"\n'
        'registry = "demo.registry:registry"\n[[variants]]\nname = "cpu"\nbackend = "cpu"\narchs = []\n'
        '[publish]\ndefault_target = "local"\n[publish.targets.local]\nurl = "file://{out}/index"\n'
        f'[publish.targets.s3]\nurl = "s3://{bucket}/simple"\nregion = "us-east-1"\nendpoint = "{endpoint}"\n'
    )
    return config


@pytest.fixture
def s3_index(tmp_path: Path, s3_store: S3Store) -> str:
    run = make_run(tmp_path / "run", {"cpu": [("demo-pkg", "1.0+cpu")]})
    publish(run, s3_store, PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cpu"]),
            PublishSteps(clock=lambda: 1.7e9))
    return f"s3://{s3_store.bucket}/simple/nightly/cpu/simple/"


def test_an_s3_url_is_verified_through_the_store_with_the_target_settings(
        tmp_path: Path, s3_index: str, s3_store: S3Store, s3_endpoint: str, capsys) -> None:
    config = _s3_config(tmp_path, s3_store.bucket, s3_endpoint)
    assert main(["verify", s3_index, "--config", str(config), "--no-install"]) == EXIT_OK, capsys.readouterr()
    assert f"OK: {s3_index}: 4 pages, 1 files, 0 problems" in capsys.readouterr().out
    key = "simple/nightly/cpu/simple/demo-pkg/demo_pkg-1.0+cpu-py3-none-any.whl"
    advertised = _sha256(s3_store.client.get_object(Bucket=s3_store.bucket, Key=key)["Body"].read())
    s3_store.client.put_object(Bucket=s3_store.bucket, Key=key, Body=b"tampered")  # behind Kiln's back
    assert main(["verify", s3_index, "--config", str(config), "--no-install"]) != EXIT_OK
    out = capsys.readouterr().out
    assert f"{s3_index}demo-pkg/demo_pkg-1.0%2Bcpu-py3-none-any.whl has sha256={_sha256(b'tampered')}" in out, out
    assert advertised in out


def test_s3_settings_come_from_the_publish_target_in_that_bucket(tmp_path: Path) -> None:
    from kiln.tasks.project.config import load_config
    from kiln.tasks.releasing import store_settings_for

    config = load_config(_s3_config(tmp_path, "kiln-wheels", "http://127.0.0.1:5000"))
    settings = store_settings_for(config, "s3://kiln-wheels/simple/nightly/cpu/simple/")
    assert (settings.region, settings.endpoint) == ("us-east-1", "http://127.0.0.1:5000")
    assert store_settings_for(config, "s3://other-bucket/simple/") == StoreSettings()


@pytest.mark.slow
def test_pip_and_uv_install_an_s3_index_through_kiln_s3_store(s3_index: str, s3_endpoint: str, s3_session) -> None:
    settings = StoreSettings(region="us-east-1", endpoint=s3_endpoint, session=s3_session)
    report = verify_index(s3_index, settings=settings, timeout=240)
    assert report.ok, report.summary()
    assert report.installs == {"pip demo-pkg==1.0+cpu": "ok", "uv demo-pkg==1.0+cpu": "ok"}
    assert any("through Kiln's server on loopback over s3://" in note for note in report.notes)


def test_kiln_server_without_a_json_page_is_checked_from_its_html(alpha: Path) -> None:
    (alpha / "alpha" / "index.json").unlink()
    with IndexServer(LocalStore(alpha)) as server:
        report = verify_index(server.url, install=False)
    assert report.ok and (report.pages, report.files) == (3, 2), report.summary()
    assert report.notes == [f"1 page(s) have no PEP 691 JSON form; checked from their HTML alone: {server.url}alpha/"]


@pytest.mark.parametrize("extra", ["ftp://mirror/simple", "pypi.org/simple", "https://h/a b"])
def test_a_bad_extra_index_url_is_refused_naming_it_before_anything_is_fetched(alpha: Path, capsys, extra: str) -> None:
    assert main(["verify", alpha.as_uri(), "--extra-index-url", extra]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert repr(extra) in captured.err and captured.out == ""
