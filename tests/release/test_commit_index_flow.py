"""The per-commit index through publish_flow: recorded, printed, linked, verified; held back when incomplete."""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from kiln.core.fsutil import sha256_bytes
from kiln.core.manifest import RunManifest
from kiln.core.record import Checkout
from kiln.core.s3 import S3Store, make_client
from kiln.core.store import LocalStore
from kiln.flows.publish import publish_flow
from kiln.flows.report.summary import render_markdown, render_text
from kiln.release.read.fetch import StoreSettings
from kiln.release.read.verify import check_links, verify_index
from tests.helpers.pageparse import parse_json
from tests.helpers.runkit import make_record

from .test_publish_flow import config_path  # noqa: F401 - the fixture: a two-variant demo project

COMMIT = "c0ffee0123456789abcdef0123456789abcdef01"
CHECKOUT = Checkout(commit=COMMIT, commit_time=1764536823, in_git=True)
pytestmark = pytest.mark.slow


def test_a_nightly_publish_records_prints_and_links_its_commits_index(prefect_server, tmp_path: Path,
                                                                       config_path: str) -> None:  # noqa: F811
    out = tmp_path / "run"
    run = make_record(config_path, out, {"cu130": [("demo", "1.0.dev5+cu130")], "cpu": [("demo", "1.0.dev5+cpu")]},
                      source=CHECKOUT)
    state = publish_flow(config_path=config_path, out=str(out), run_id=run.run_id, return_state=True)
    assert state.is_completed(), state.message
    store = LocalStore(out / "index")
    urls = [f"{store.url}/nightly/{v}/commits/c0ffee012345/simple/" for v in ("cpu", "cu130")]
    manifest = RunManifest.load(run.view)
    assert manifest.info["commit_index_url"] == urls
    text = render_text(manifest)  # what `kiln nightly` prints at the end
    install = (f"env PIP_CONFIG_FILE=/dev/null pip install --isolated --index-url {urls[0]} --no-deps demo==1.0.dev5+cpu && "
               f"env PIP_CONFIG_FILE=/dev/null pip install --isolated --index-url {urls[0]} --extra-index-url https://pypi.org/simple "
               "demo==1.0.dev5+cpu")  # pinned, like the channel's
    assert f"this commit's index: {urls[0]}\n    install: {install}\n" in text
    markdown = render_markdown(manifest)
    assert f"- this commit's wheels only: <{urls[1]}>" in markdown
    for url in urls:  # `kiln verify --no-install` reads the channel objects the commit's pages link
        report, newest = check_links(url, 30)
        assert not report.problems and sorted(newest) == ["demo"], report.problems
    installed = verify_index(urls[0], install=True, timeout=300)  # real pip and uv follow the relative links
    assert not installed.problems, installed.problems
    assert installed.installs == {"pip demo==1.0.dev5+cpu": "ok", "uv demo==1.0.dev5+cpu": "ok"}


def test_a_release_publish_writes_no_commit_index(prefect_server, tmp_path: Path,
                                                   config_path: str) -> None:  # noqa: F811
    out = tmp_path / "run"
    run = make_record(config_path, out, {"cpu": [("demo", "1.0+cpu")]}, source=CHECKOUT)
    state = publish_flow(config_path=config_path, out=str(out), run_id=run.run_id, channel="release",
                         return_state=True)
    assert state.is_completed(), state.message
    assert LocalStore(out / "index").list("release/cpu/simple/demo/")
    assert all("/commits/" not in key for key in LocalStore(out / "index").list("release/cpu/"))
    assert RunManifest.load(run.view).info["commit_index_url"] == []


def test_on_s3_the_commit_index_resolves_and_a_variant_with_a_conflict_gets_none(
    prefect_server, tmp_path: Path, config_path: str, s3_endpoint: str, s3_session: Any,  # noqa: F811
    s3_bucket: str,
) -> None:
    first = make_record(config_path, tmp_path / "first", {"cu130": [("demo", "1.0")]}, payload="a")
    assert publish_flow(config_path=config_path, out=str(tmp_path / "first"), target="s3", run_id=first.run_id,
                        return_state=True).is_completed()
    second = make_record(config_path, tmp_path / "second", {"cu130": [("demo", "1.0"), ("other", "2.0")],
                                                            "cpu": [("other", "2.0")]}, payload="b", source=CHECKOUT)
    state = publish_flow(config_path=config_path, out=str(tmp_path / "second"), target="s3", run_id=second.run_id,
                         return_state=True)
    assert state.is_failed()  # demo 1.0 with other bytes: that unit fails, the rest is published
    store = S3Store(make_client(s3_session, "us-east-1", s3_endpoint), s3_bucket, "simple")
    assert not store.list("nightly/cu130/commits/c0ffee012345/")  # incomplete: no index for this commit's cu130
    assert "per-commit index of `cu130` not written" in str(RunManifest.load(second.view).info["publish_plan"])
    page_key = "nightly/cpu/commits/c0ffee012345/simple/other/index.json"
    (entry,) = parse_json(store.get(page_key))["files"]
    target = posixpath.normpath(posixpath.dirname(page_key) + "/" + unquote(entry["url"]))
    assert target == "nightly/cpu/simple/other/other-2.0-py3-none-any.whl"
    assert sha256_bytes(store.get(target)) == entry["hashes"]["sha256"]
    # `kiln verify s3://…/commits/<commit12>/simple/` reads the channel objects its pages link, and pip and uv
    # install through Kiln's loopback server at the commit index's path
    settings = StoreSettings("us-east-1", s3_endpoint, session=s3_session)
    report = verify_index(f"s3://{s3_bucket}/simple/nightly/cpu/commits/c0ffee012345/simple/", install=True,
                          timeout=300, settings=settings)
    assert not report.problems and not report.refused, report.problems
    assert report.installs == {"pip other==2.0": "ok", "uv other==2.0": "ok"}
