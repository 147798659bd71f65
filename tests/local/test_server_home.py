"""The private Prefect home, the auth string and the watchdog's settings: plain functions, no server."""

from __future__ import annotations

import logging
import os
import stat
import time

import pytest

from kiln.flows.local import server_home, server_watch


def test_a_new_home_is_created_private(tmp_path):
    home = server_home.private_home(tmp_path / "deep" / "prefect-home")
    assert stat.S_IMODE(home.stat().st_mode) == 0o700


def test_an_existing_home_open_to_others_is_named_in_a_warning(tmp_path, caplog):
    home = tmp_path / "shared-home"
    home.mkdir()
    home.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="kiln.flows.local.server_home"):
        server_home.private_home(home)
    (record,) = [r for r in caplog.records if str(home) in r.getMessage()]
    assert "chmod 700" in record.getMessage() and "755" in record.getMessage()
    assert stat.S_IMODE(home.stat().st_mode) == 0o755  # warned, not changed behind the owner's back


def test_a_private_home_gets_no_warning(tmp_path, caplog):
    home = tmp_path / "own-home"
    home.mkdir(mode=0o700)
    with caplog.at_level(logging.WARNING, logger="kiln.flows.local.server_home"):
        server_home.private_home(home)
    assert not caplog.records


def test_the_auth_string_is_random_owner_only_and_stable_per_home(tmp_path):
    first, other = tmp_path / "one", tmp_path / "two"
    first.mkdir(mode=0o700)
    other.mkdir(mode=0o700)
    assert server_home.existing_auth_string(first) is None
    secret = server_home.auth_string(first)
    assert len(secret) >= 40 and server_home.auth_string(first) == secret
    assert server_home.auth_string(other) != secret
    assert stat.S_IMODE((first / server_home.AUTH_FILE).stat().st_mode) == 0o600


def test_a_symlink_planted_as_the_auth_file_is_not_followed(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / server_home.AUTH_FILE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(server_home.InfrastructureError, match=server_home.AUTH_FILE):
        server_home.auth_string(home)
    assert not (tmp_path / "elsewhere").exists()


def test_a_command_holding_the_marker_keeps_the_server_in_use(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    assert not server_home.in_use(home)
    server_home.mark_used(home)  # held until this process exits (or the marker is let go below)
    try:
        assert server_home.in_use(home)
        assert server_home.last_used(home, 0.0) >= time.time() - 60
    finally:
        os.close(server_home._held.pop(home))
    assert not server_home.in_use(home)


def test_why_stop_names_a_deleted_home_and_an_idle_server(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    home_id = (home.stat().st_dev, home.stat().st_ino)
    now = time.time()
    assert server_watch.why_stop(home, home_id, idle_s=100, started=now, now=now + 50) == ""
    assert "KILN_SERVER_IDLE_SECONDS=100" in server_watch.why_stop(home, home_id, 100, now, now + 150)
    home.rename(tmp_path / "moved")
    assert "is gone" in server_watch.why_stop(home, home_id, 100, now, now)
    home.mkdir(mode=0o700)  # another directory at the same path is not the server's home
    assert "is gone" in server_watch.why_stop(home, home_id, 100, now, now)


@pytest.mark.parametrize("raw, expected", [("", 7.0), ("30", 30.0), ("0", 7.0), ("-1", 7.0), ("nan", 7.0),
                                           ("inf", 7.0), ("a day", 7.0)])
def test_watchdog_seconds_settings_accept_only_positive_finite_numbers(raw, expected):
    assert server_watch.seconds_setting({"X": raw}, "X", 7.0) == expected


def test_a_run_link_on_the_local_server_comes_with_where_its_password_is_and_never_the_password(tmp_path):
    from kiln.flows.local import server

    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    secret = server.auth_string(home)
    info = server.ServerInfo(pid=os.getpid(), port=4321, api_url="http://127.0.0.1:4321/api", prefect_version="3",
                             log=str(home / "log"), started_at=time.time())
    server._write_state(home, info)
    login = server.ui_login_for(home, "http://127.0.0.1:4321/runs/flow-run/abc")
    assert login is not None and str(home / server.AUTH_FILE) in login and secret not in login
    # the login page that lands on the run: the run's link itself would open on "Authentication failed"
    assert "http://127.0.0.1:4321/login?redirect=/runs/flow-run/abc " in login
    assert server.ui_login_for(home, "https://prefect.example.org/runs/flow-run/abc") is None  # a team's server
    assert server.ui_login_for(tmp_path / "no-server-here", "http://127.0.0.1:4321/runs/flow-run/abc") is None
