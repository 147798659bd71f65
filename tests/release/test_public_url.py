"""What users download through a CDN in front of the bucket is what the index says (issue 42, part 5).

The S3 store is moto's server on loopback. The CDN is :class:`CachingProxy`, a loopback stand-in that
fronts the real bucket (path -> key, read with the store's signed client as a CDN's origin access does) and caches what it fetched: honouring
``Cache-Control`` it is faithful; ``ignores_cache_control`` makes it the fault injector, a CDN that keeps
serving a page it cached before the page changed; ``stale`` seeds it with old bytes under a file's path.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from botocore.exceptions import ClientError

from kiln.core.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from kiln.core.fsutil import sha256_bytes
from kiln.core.s3 import S3Store
from kiln.release.cli import verify_command
from kiln.release.publish.pages import IMMUTABLE_CACHE, NIGHTLY_PAGE_CACHE, RELEASE_PAGE_CACHE
from kiln.release.publish.plan import Plan
from kiln.release.publish.protocol import PublishRequest, PublishSteps, publish
from kiln.release.read.fetch import StoreSettings
from kiln.release.read.public import check_public, published_expectations
from tests.helpers.runkit import CU130, make_run, make_variant_run


class CachingProxy:
    """A loopback stand-in for a CDN in front of the bucket; see the module docstring."""

    def __init__(self, store: S3Store, ignores_cache_control: bool = False, stale: dict[str, bytes] | None = None):
        self.client, self.bucket, self.ignores = store.client, store.bucket, ignores_cache_control  # signs, as OAC
        self.cache: dict[str, bytes] = dict(stale or {})
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                status, data = proxy.fetch(self.path)
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"

    def fetch(self, path: str) -> tuple[int, bytes]:
        if path in self.cache:
            return 200, self.cache[path]
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=unquote(path.lstrip("/")))
        except ClientError as exc:
            return int(exc.response["ResponseMetadata"]["HTTPStatusCode"]), b""
        with response["Body"] as body:
            data, cache_control = body.read(), response.get("CacheControl", "")
        if self.ignores or "no-cache" not in cache_control:
            self.cache[path] = data
        return 200, data

    @contextmanager
    def running(self) -> Iterator[CachingProxy]:
        thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.server.shutdown()
            self.server.server_close()
            thread.join(timeout=10)


def _head(store: S3Store, key: str) -> dict[str, Any]:
    return store.client.head_object(Bucket=store.bucket, Key=store.prefix + key)


def _publish(store: S3Store, run: Any, channel: str, variants: list[str]) -> Plan:
    return publish(run, store, PublishRequest(channel=channel, channel_prefix=channel, variants=variants),
                   PublishSteps(clock=lambda: 1_700_000_000.0))


def test_s3_objects_carry_cache_control_by_kind_and_channel_and_their_sha256(s3_store: S3Store,
                                                                           tmp_path: Path) -> None:
    nightly = make_variant_run(tmp_path / "nightly", "demo", "1.0", {"cu130": CU130})
    _publish(s3_store, nightly, "nightly", ["cu130"])
    release = make_run(tmp_path / "release", {"cu130": [("demo", "2.0+cu130")]})
    _publish(s3_store, release, "release", ["cu130"])
    files = "nightly/wheel-variants/simple/demo"
    variants_file = next(k for k in s3_store.list(f"{files}/variants/") if k.endswith("-variants.json"))
    expected = {
        "nightly/cu130/simple/demo/demo-1.0+cu130-py3-none-any.whl": IMMUTABLE_CACHE,
        "nightly/cu130/simple/demo/demo-1.0+cu130-py3-none-any.whl.metadata": IMMUTABLE_CACHE,
        variants_file: IMMUTABLE_CACHE,  # its key is its content's hash: never re-used
        "nightly/cu130/simple/index.html": NIGHTLY_PAGE_CACHE,
        "nightly/cu130/simple/demo/index.json": NIGHTLY_PAGE_CACHE,
        f"{files}/index.html": NIGHTLY_PAGE_CACHE,
        "release/cu130/simple/demo/demo-2.0+cu130-py3-none-any.whl": IMMUTABLE_CACHE,
        "release/cu130/simple/index.json": RELEASE_PAGE_CACHE,
        "release/cu130/simple/demo/index.html": RELEASE_PAGE_CACHE,
    }
    for key, cache_control in expected.items():
        head = _head(s3_store, key)
        assert head["CacheControl"] == cache_control, key
        assert head["Metadata"] == {"sha256": sha256_bytes(s3_store.get(key) or b"")}, key
    assert (NIGHTLY_PAGE_CACHE, RELEASE_PAGE_CACHE) == ("no-cache", "public, max-age=300")


def _bucket_proxy(store: S3Store, endpoint: str, **kwargs: Any) -> CachingProxy:
    return CachingProxy(store, **kwargs)


def _verify(store: S3Store, endpoint: str, session: Any, public_url: str) -> int:
    return verify_command(f"s3://{store.bucket}/{store.prefix}nightly/cu130/simple/", install=False,
                          settings=StoreSettings(endpoint=endpoint, session=session),
                          public_url=f"{public_url}{store.prefix}nightly/cu130/simple/")


def test_kiln_verify_public_url_names_the_page_a_cdn_ignoring_cache_control_serves_after_a_publish(
    s3_store: S3Store, s3_endpoint: str, s3_session: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    _publish(s3_store, make_run(tmp_path / "one", {"cu130": [("demo", "1.0+cu130")]}), "nightly", ["cu130"])
    faithful, stale = _bucket_proxy(s3_store, s3_endpoint), _bucket_proxy(s3_store, s3_endpoint,
                                                                            ignores_cache_control=True)
    with faithful.running(), stale.running():
        assert _verify(s3_store, s3_endpoint, s3_session, faithful.url) == EXIT_OK
        assert _verify(s3_store, s3_endpoint, s3_session, stale.url) == EXIT_OK  # warms its cache
        _publish(s3_store, make_run(tmp_path / "two", {"cu130": [("demo", "1.1+cu130")]}), "nightly", ["cu130"])
        capsys.readouterr()
        assert _verify(s3_store, s3_endpoint, s3_session, faithful.url) == EXIT_OK
        assert _verify(s3_store, s3_endpoint, s3_session, stale.url) == EXIT_FAILED
    out = capsys.readouterr().out
    assert "problem: demo/index.json: " in out and "problem: demo/index.html: " in out
    assert "serves other bytes than the index says" in out
    assert "demo-1.1" not in out.split("FAILED: through", 1)[1]  # new files are fetched fresh: not named


def test_kiln_verify_public_url_names_a_file_the_cdn_serves_with_other_bytes(
    s3_store: S3Store, s3_endpoint: str, s3_session: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    _publish(s3_store, make_run(tmp_path / "one", {"cu130": [("demo", "1.0+cu130")]}), "nightly", ["cu130"])
    wheel = f"/{s3_store.prefix}nightly/cu130/simple/demo/demo-1.0%2Bcu130-py3-none-any.whl"
    proxy = _bucket_proxy(s3_store, s3_endpoint, stale={wheel: b"an earlier life of this bucket"})
    with proxy.running():
        assert _verify(s3_store, s3_endpoint, s3_session, proxy.url) == EXIT_FAILED
    out = capsys.readouterr().out
    assert "problem: demo/demo-1.0+cu130-py3-none-any.whl: " in out
    assert f"sha256 {sha256_bytes(b'an earlier life of this bucket')}" in out
    assert out.count("  problem: ") == 1  # its sidecar and the pages are served as written


def test_after_a_publish_its_new_files_and_changed_pages_are_checked_through_the_public_url(
    s3_store: S3Store, s3_endpoint: str, tmp_path: Path,
) -> None:
    _publish(s3_store, make_run(tmp_path / "one", {"cu130": [("demo", "1.0+cu130")]}), "nightly", ["cu130"])
    stale = _bucket_proxy(s3_store, s3_endpoint, ignores_cache_control=True)
    with stale.running():
        public_url = stale.url + s3_store.prefix
        first = check_public(public_url, [e for e in published_expectations(
            s3_store, _publish(s3_store, make_run(tmp_path / "one", {"cu130": [("demo", "1.0+cu130")]}),
                               "nightly", ["cu130"]))])
        assert first.ok and first.checked == 0  # a re-run adds nothing and changes no page: nothing new
        for page in ("index.html", "index.json", "demo/index.html", "demo/index.json"):
            stale.fetch(f"/{s3_store.prefix}nightly/cu130/simple/{page}")  # users read the pages: cached
        plan = _publish(s3_store, make_run(tmp_path / "two", {"cu130": [("demo", "1.1+cu130")]}), "nightly",
                        ["cu130"])
        expected = published_expectations(s3_store, plan)
        report = check_public(public_url, expected)
    base = "nightly/cu130/simple/demo"
    assert sorted(e.path for e in expected if e.kind == "file") == [
        f"{base}/demo-1.1+cu130-py3-none-any.whl", f"{base}/demo-1.1+cu130-py3-none-any.whl.metadata"]
    named = sorted(p.split(":", 1)[0] for p in report.problems)
    assert named == [f"{base}/index.html", f"{base}/index.json"]  # the root lists the same project: unchanged


def test_a_public_url_that_is_not_http_is_refused_before_anything_is_fetched(capsys: pytest.CaptureFixture[str],
                                                                            tmp_path: Path) -> None:
    from kiln.flows.cli import main

    assert main(["verify", tmp_path.as_uri() + "/", "--no-install", "--public-url", "ftp://cdn.example/"]) == (
        EXIT_USAGE)
    assert "public URL 'ftp://cdn.example/' must be an http:// or https:// URL" in capsys.readouterr().err


PUBLIC_URL_TOML = """
[project]
package = "demo"
distribution = "demo"
version = "1.0"
source = "src"
registry = "demo.registry:registry"

[[variants]]
name = "cu130"
backend = "cuda"
archs = ["9.0"]

[publish]
default_target = "s3"

[publish.targets.s3]
url = "s3://{bucket}/simple"
region = "us-east-1"
endpoint = "{endpoint}"
public_url = "{public_url}"

[permissions.publish-nightly]
read = ["nightly/"]
write = ["nightly/"]
credentials = {{ ambient = true }}
"""


@pytest.mark.slow
def test_the_publish_flow_checks_what_the_target_public_url_serves_and_fails_naming_a_stale_page(
    prefect_server, s3_store: S3Store, s3_endpoint: str, tmp_path: Path,
) -> None:
    from kiln.core.manifest import RunManifest
    from kiln.flows.publish import publish_flow
    from tests.helpers.runkit import make_record

    stale = _bucket_proxy(s3_store, s3_endpoint, ignores_cache_control=True)
    (tmp_path / "src").mkdir()
    config = tmp_path / "kiln.toml"
    config.write_text(PUBLIC_URL_TOML.format(bucket=s3_store.bucket, endpoint=s3_endpoint,
                                             public_url=stale.url + s3_store.prefix))
    with stale.running():
        units = {}
        for name, version in (("first", "1.0+cu130"), ("second", "1.1+cu130")):  # the first check fills its cache
            run = make_record(config, tmp_path / name, {"cu130": [("demo", version)]})
            state = publish_flow(config_path=str(config), out=str(tmp_path / name), run_id=run.run_id,
                                 return_state=True)
            units[name] = {u.id: u for u in RunManifest.load(run.view).units}["publish/public-url"]
    assert units["first"].state == "completed" and units["first"].message.startswith("OK: through ")
    assert state.is_failed() and units["second"].state == "failed"
    assert "problem: nightly/cu130/simple/demo/index.json: " in units["second"].message
    assert "demo-1.1" not in units["second"].message  # the new files themselves are served as written


def test_a_release_page_a_cache_still_holds_is_looked_at_again_within_its_max_age_and_a_file_never_waits(
    s3_store: S3Store, s3_endpoint: str, tmp_path: Path,
) -> None:
    from kiln.release.publish.pages import page_max_age
    from kiln.release.read.public import PAGE_POLL_S

    _publish(s3_store, make_run(tmp_path / "one", {"cu130": [("demo", "1.0+cu130")]}), "release", ["cu130"])
    base = f"/{s3_store.prefix}release/cu130/simple"
    new_wheel = f"{base}/demo/demo-1.1%2Bcu130-py3-none-any.whl"
    stale = _bucket_proxy(s3_store, s3_endpoint, ignores_cache_control=True)
    now, sleeps = [0.0], []

    def expire(seconds: float) -> None:  # the fake clock: time passes, and the cache's copies expire (files too)
        sleeps.append(seconds)
        now[0] += seconds
        stale.cache.clear()
        stale.cache[new_wheel] = b"not what was published"

    with stale.running():
        for page in ("index.html", "index.json", "demo/index.html", "demo/index.json"):
            stale.fetch(f"{base}/{page}")  # users read the pages: cached, with max-age=300
        stale.cache[new_wheel] = b"not what was published"
        plan = _publish(s3_store, make_run(tmp_path / "two", {"cu130": [("demo", "1.1+cu130")]}), "release",
                        ["cu130"])
        expected = published_expectations(s3_store, plan)
        at_once = check_public(stale.url + s3_store.prefix, expected)
        waited = check_public(stale.url + s3_store.prefix, expected, page_grace_s=page_max_age("release"),
                              clock=lambda: now[0], sleep=expire)
    assert sorted(p.split(":", 1)[0] for p in at_once.problems) == [
        "release/cu130/simple/demo/demo-1.1+cu130-py3-none-any.whl", "release/cu130/simple/demo/index.html",
        "release/cu130/simple/demo/index.json"]
    assert [p.split(":", 1)[0] for p in waited.problems] == ["release/cu130/simple/demo/demo-1.1+cu130-py3-none-any.whl"]
    assert sleeps == [PAGE_POLL_S]  # the pages showed once the cache let them go; the file was not waited for
