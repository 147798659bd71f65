"""Credentials are explicit: a step that talks to S3 names where its credentials come from, or kiln.toml is refused.

Each test writes a small kiln.toml and loads it the way every command does
(``load_config``); nothing reaches a store.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.errors import ConfigError
from kiln.flows.run.credentials import session_for
from kiln.tasks.project.config import load_config

REPO = Path(__file__).resolve().parents[2]

PROJECT = """
[project]
package = "demo_pkg"
distribution = "demo-pkg"
version = "1.0"
source = "src"
registry = "demo_pkg.registry:registry"

[[variants]]
name = "cpu"
backend = "cpu"

[publish]
default_target = "{target}"

[publish.targets.local]
url = "file://{{out}}/index"

[publish.targets.s3]
url = "s3://kiln-wheels/simple"
region = "us-east-1"
"""
LOCAL_ONLY = PROJECT.split("[publish.targets.s3]")[0]
S3_ARTIFACTS = '\n[artifacts]\nurl = "s3://kiln-artifacts/store"\nregion = "us-east-1"\n'


def _permission(step: str, credentials: str | None) -> str:
    line = f"credentials = {credentials}\n" if credentials is not None else ""
    return f'\n[permissions.{step}]\nread = ["artifacts/"]\nwrite = ["artifacts/"]\n{line}'


def _write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "src").mkdir(exist_ok=True)
    path = tmp_path / "kiln.toml"
    path.write_text(text)
    return path




@pytest.mark.parametrize("target", ["s3", "local"])
def test_a_publisher_without_credentials_is_refused_at_load_naming_the_step(tmp_path, target):
    # Any s3:// publish target counts, default or not: `kiln publish --to s3` may pick it.
    path = _write(tmp_path, PROJECT.format(target=target) + _permission("publish-nightly", None))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "permissions.publish-nightly: no credentials chosen" in message
    assert "s3://kiln-wheels/simple" in message  # why it needs some
    assert "ambient = true" in message and "block =" in message and "role_arn =" in message  # what to write


@pytest.mark.parametrize("step", ["build", "test", "bench", "publish-release"])
def test_an_s3_artifact_store_makes_every_step_choose(tmp_path, step):
    text = LOCAL_ONLY.format(target="local") + S3_ARTIFACTS + _permission(step, None)
    with pytest.raises(ConfigError, match=rf"permissions\.{step}: no credentials chosen.*s3://kiln-artifacts/store"):
        load_config(_write(tmp_path, text))


def test_every_step_without_a_choice_is_named_at_once(tmp_path):
    text = PROJECT.format(target="s3") + S3_ARTIFACTS + _permission("build", None) + _permission("bench", None)
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text))
    assert "permissions.build: no credentials chosen" in str(info.value)
    assert "permissions.bench: no credentials chosen" in str(info.value)


def test_a_step_that_touches_only_local_paths_needs_no_credentials(tmp_path):
    # A build with a file:// artifact store never asks for credentials, so it needs no choice.
    text = PROJECT.format(target="local") + _permission("build", None)
    config = load_config(_write(tmp_path, text))
    assert config.permissions["build"].credentials is None
    with pytest.raises(ConfigError, match=r"\[permissions.build\] names no credentials"):
        session_for(config, "build")  # and if anything asked, there is no fall-back to the worker's


def test_an_empty_credentials_table_is_refused(tmp_path):
    path = _write(tmp_path, PROJECT.format(target="s3") + _permission("publish-nightly", "{}"))
    with pytest.raises(ConfigError, match=r"permissions.publish-nightly.credentials: give exactly one of"):
        load_config(path)


def test_ambient_true_is_accepted_and_logged_as_what_kiln_toml_says(tmp_path, kiln_log):
    path = _write(tmp_path, PROJECT.format(target="s3") + _permission("publish-nightly", "{ ambient = true }"))
    config = load_config(path)
    session = session_for(config, "publish-nightly")
    assert session.region_name == "us-east-1"
    lines = {r.getMessage() for r in kiln_log.records if "ambient" in r.getMessage()}
    assert lines == {"step publish-nightly uses the worker's ambient credentials, as [permissions.publish-nightly] "
                     "credentials = { ambient = true } says"}


@pytest.mark.parametrize("path", [REPO / "kiln.toml", *sorted((REPO / "tests" / "fixtures" / "projects").glob("*/kiln.toml"))],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_the_repos_kiln_toml_files_load_and_name_every_source(path):
    config = load_config(path)
    for step, permission in config.permissions.items():
        assert permission.credentials is not None, step
