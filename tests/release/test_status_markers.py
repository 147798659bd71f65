"""PEP 792 project status markers: kiln.toml's [project] status, on every project page Kiln writes."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from kiln.core.dists import make_distribution
from kiln.core.errors import ConfigError, InvalidInputError
from kiln.core.store import LocalStore
from kiln.release.index.render import ProjectStatus, generate, project_pages
from kiln.release.publish.protocol import PublishRequest, publish
from kiln.tasks.project.config import parse_config
from tests.helpers.pageparse import parse_html, parse_json
from tests.helpers.runkit import make_run

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "projects" / "tiny"
SHA = "a" * 64


def _config(**project: object):
    data = tomllib.loads((TINY / "kiln.toml").read_text())
    data["project"].update(project)
    return parse_config(data, TINY)


def test_status_defaults_to_active_with_no_reason() -> None:
    assert _config().project.page_status == ProjectStatus("active", "")


@pytest.mark.parametrize("status", ["active", "archived", "quarantined", "deprecated"])
def test_each_pep792_status_is_accepted_with_its_reason(status: str) -> None:
    config = _config(status=status, status_reason="superseded by other-kernels")
    assert config.project.page_status == ProjectStatus(status, "superseded by other-kernels")  # type: ignore[arg-type]


def test_an_unknown_status_is_refused_naming_the_key_and_the_choices() -> None:
    with pytest.raises(ConfigError) as caught:
        _config(status="retired")
    message = str(caught.value)
    assert "project.status:" in message
    assert all(name in message for name in ("'active'", "'archived'", "'quarantined'", "'deprecated'"))


@pytest.mark.parametrize("reason", ["two\nlines", "a bell \x07", "x" * 501])
def test_a_reason_that_is_not_one_short_line_is_refused_naming_the_key(reason: str) -> None:
    with pytest.raises(ConfigError, match=r"project\.status_reason: .*one line of text"):
        _config(status="archived", status_reason=reason)


def test_a_status_made_outside_kiln_toml_is_checked_too() -> None:
    with pytest.raises(InvalidInputError, match="'retired' is not one of active, archived, quarantined, deprecated"):
        ProjectStatus("retired")  # type: ignore[arg-type]


def _dist(version: str = "1.0"):
    return make_distribution(f"demo-{version}-py3-none-any.whl", SHA, 10, 1_700_000_000)


def test_the_html_page_carries_the_status_and_its_escaped_reason_and_declares_api_1_4() -> None:
    status = ProjectStatus("deprecated", 'use "other" <now> & later')
    html = project_pages("demo", [_dist()], status)["demo/index.html"]
    meta, anchors = parse_html(html)
    assert meta["pypi:repository-version"] == "1.4"
    assert meta["pypi:project-status"] == "deprecated"
    assert meta["pypi:project-status-reason"] == 'use "other" <now> & later'
    assert b"&quot;other&quot; &lt;now&gt; &amp; later" in html  # escaped in the raw bytes
    assert [a.text for a in anchors] == ["demo-1.0-py3-none-any.whl"]


def test_the_json_page_carries_project_status_beside_the_files_and_declares_api_1_4() -> None:
    page = parse_json(project_pages("demo", [_dist()], ProjectStatus("archived", "done: ✓"))["demo/index.json"])
    assert page["meta"] == {"api-version": "1.4"}
    assert page["project-status"] == {"status": "archived", "reason": "done: ✓"}
    assert [f["filename"] for f in page["files"]] == ["demo-1.0-py3-none-any.whl"]


def test_an_active_project_states_its_status_and_no_reason() -> None:
    pages = generate([_dist()])
    meta, _ = parse_html(pages["demo/index.html"])
    assert meta["pypi:project-status"] == "active" and "pypi:project-status-reason" not in meta
    assert parse_json(pages["demo/index.json"])["project-status"] == {"status": "active"}
    root_meta, _ = parse_html(pages["index.html"])
    assert root_meta == {"pypi:repository-version": "1.4"}  # a status is a project's, never the root's
    assert parse_json(pages["index.json"])["meta"] == {"api-version": "1.4"}


def test_a_publish_writes_the_configured_status_on_its_project_and_active_on_the_others(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", {"cpu": [("demo", "1.0")]})
    pinned = make_run(tmp_path / "pins", {"cpu": [("helper", "2.0")]}).artifacts_of("wheel")[0]
    store = LocalStore(tmp_path / "index")
    publish(run, store, PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cpu"],
                                       extra=[(None, tmp_path / "pins" / pinned.path)],
                                       statuses={"demo": ProjectStatus("deprecated", "moved to demo2")}))
    demo = store.get("nightly/cpu/simple/demo/index.json")
    helper = store.get("nightly/cpu/simple/helper/index.json")
    assert demo is not None and helper is not None
    assert parse_json(demo)["project-status"] == {"status": "deprecated", "reason": "moved to demo2"}
    assert parse_json(helper)["project-status"] == {"status": "active"}
    html = store.get("nightly/cpu/simple/demo/index.html")
    assert html is not None and parse_html(html)[0]["pypi:project-status"] == "deprecated"


@pytest.mark.parametrize("status", ["archived", "quarantined"])
def test_an_archived_or_quarantined_project_takes_no_new_file_but_its_pages_state_the_status(
        tmp_path: Path, status: str) -> None:
    store = LocalStore(tmp_path / "index")
    first = make_run(tmp_path / "one", {"cpu": [("demo", "1.0")]})
    publish(first, store, PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cpu"]))
    frozen = {"demo": ProjectStatus(status, "moved to demo2")}
    newer = publish(make_run(tmp_path / "two", {"cpu": [("demo", "1.1")]}), store,
                    PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cpu"], statuses=frozen))
    assert newer.frozen == {"cpu/demo-1.1-py3-none-any.whl": f"demo is {status} ([project] status, PEP 792): it "
                                                              "takes no new files"}
    assert newer.keys("added") == [] and store.get("nightly/cpu/simple/demo/demo-1.1-py3-none-any.whl") is None
    assert "`cpu/demo-1.1-py3-none-any.whl` not uploaded" in newer.to_markdown()
    again = publish(first, store,
                    PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cpu"], statuses=frozen))
    assert again.keys("present") and not again.frozen  # what it already holds stays, its page states the status
    page = parse_json(store.get("nightly/cpu/simple/demo/index.json") or b"{}")
    assert page["project-status"]["status"] == status and page["versions"] == ["1.0"]


def test_a_changed_status_rewrites_the_page_of_an_already_published_project(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", {"cpu": [("demo", "1.0")]})
    store = LocalStore(tmp_path / "index")
    publish(run, store, PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cpu"]))
    again = publish(run, store, PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cpu"],
                                               statuses={"demo": ProjectStatus("deprecated")}))
    assert again.keys("present") and not again.keys("added")
    assert "nightly/cpu/simple/demo/index.json" in again.pages
    page = store.get("nightly/cpu/simple/demo/index.json")
    assert page is not None and parse_json(page)["project-status"] == {"status": "deprecated"}
