"""What the caller's pip configuration adds behind a command's own indexes, and which setting offered a file."""

from __future__ import annotations

import os
from pathlib import Path

from kiln.release.install.pipconfig import Source, caller_pip_config

EVIL = "http://127.0.0.1:9/simple/"


def _user_conf(home: Path, text: str) -> Path:
    path = home / ".config" / "pip" / "pip.conf"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def test_the_users_pip_conf_and_the_variables_are_read_and_carried_to_the_check(tmp_path):
    conf = _user_conf(tmp_path, f"[global]\nfind-links = {EVIL}a/ /opt/w\n[install]\nextra_index_url = {EVIL}\n")
    config = caller_pip_config({"PIP_EXTRA_INDEX_URL": "https://mirror/simple"}, tmp_path)
    assert Source(f"find-links in {conf}", f"{EVIL}a/") in config.sources
    assert Source(f"find-links in {conf}", "/opt/w") in config.sources
    assert Source(f"extra-index-url in {conf}", EVIL) in config.sources
    assert Source("PIP_EXTRA_INDEX_URL", "https://mirror/simple") in config.sources
    # the check's pip has a private HOME: the user's file reaches it as PIP_CONFIG_FILE
    assert config.env == {"PIP_EXTRA_INDEX_URL": "https://mirror/simple", "PIP_CONFIG_FILE": str(conf)}


def test_pip_config_file_replaces_the_users_file_and_the_null_device_means_none(tmp_path):
    _user_conf(tmp_path, f"[global]\nfind-links = {EVIL}\n")
    other = tmp_path / "other.conf"
    other.write_text("[global]\nextra-index-url = https://other/simple\n")
    named = caller_pip_config({"PIP_CONFIG_FILE": str(other)}, tmp_path)
    assert [s for s in named.sources if "pip.conf" in s.where] == []
    assert Source(f"extra-index-url in {other}", "https://other/simple") in named.sources
    assert caller_pip_config({"PIP_CONFIG_FILE": os.devnull}, tmp_path).sources == ()


def test_a_file_is_named_by_the_settings_it_lies_under_else_its_host(tmp_path):
    config = caller_pip_config({"PIP_EXTRA_INDEX_URL": EVIL, "PIP_FIND_LINKS": f"{EVIL}rt/ {tmp_path}/w"}, tmp_path)
    assert [s.where for s in config.named(f"{EVIL}rt/rt-1.whl")] == ["PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"]
    assert config.named((tmp_path / "w" / "rt-1.whl").as_uri()) == [Source("PIP_FIND_LINKS", f"{tmp_path}/w")]
    assert config.named("http://127.0.0.1:9/files/rt-1.whl") == list(config.sources[:2])
