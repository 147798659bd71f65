"""Session-wide test setup: an isolated Prefect home and one Prefect test server.

PREFECT_HOME points at a temporary directory before Prefect is imported, so
tests never touch the developer's ~/.prefect database. Flow tests share one
server per session (`prefect_server`); subprocesses that run flows get its URL
from `prefect_env`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_PREFECT_HOME = tempfile.mkdtemp(prefix="kiln-test-prefect-")
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ.pop("PREFECT_API_URL", None)
os.environ.pop("PREFECT_API_KEY", None)
# Kiln's daemon (kiln.flows.local.daemon) is off for the commands tests start; its own tests turn it on.
os.environ["KILN_DAEMON"] = "off"
# Runs publish with PyPI as their extra index; tests never query it (kiln.tasks.install_hint, issue 32).
os.environ["KILN_CHECK_EXTRA_INDEXES"] = "off"
# Test and bench environments layer one base environment (torch, Triton, numpy, pytest) made once per user and
# shared by every test and session (kiln.tasks.testing.baseenv), as tests/helpers/cuda_torch.py shares build envs.
os.environ.setdefault("KILN_TEST_ENV_CACHE", str(Path(tempfile.gettempdir()) / f"kiln-test-baseenvs-{os.getuid()}"))

from kiln.flows.local.environment import apply_defaults  # noqa: E402

apply_defaults()

REPO = Path(__file__).resolve().parent.parent


def _gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _module_rank(items: list[pytest.Item]) -> dict[str, int]:
    """0 for the scale-out module, 1 for a module with slow tests, 2 for the rest (per file)."""
    rank: dict[str, int] = {}
    for item in items:
        mine = 0 if "scaleout" in item.keywords else 1 if "slow" in item.keywords else 2
        path = _file_of(item)
        rank[path] = min(rank.get(path, 2), mine)
    return rank


def _file_of(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Longest files first (each stays whole): the README runs the suite on two pytest-xdist
    # workers, one file at a time each, and a long file handed out last is the run's tail.
    # Its --no-loadscope-reorder keeps this order: by default xdist re-sorts the files by their
    # number of tests, which hands the long one- and two-test files out last.
    rank = _module_rank(items)
    items.sort(key=lambda item: rank[_file_of(item)])
    gpu_items = [item for item in items if "gpu" in item.keywords]
    # Asking torch costs seconds of import: only when a selected test needs the answer.
    if not gpu_items or _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a GPU (none detected)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def prefect_server():
    """One Prefect API server for the whole session (SQLite in PREFECT_HOME)."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    # Heartbeats detect crashed runs in production; in tests each one only adds
    # about a second to every flow run while its thread winds down.
    with prefect_test_harness(server_startup_timeout=600), temporary_settings(
        updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}
    ):
        _bind_workers_to_this_server()
        yield
        _release_workers()


def _bind_workers_to_this_server() -> None:
    """Bind Prefect's events and log workers to the session server for the whole session.

    Both are process-wide singletons keyed without the API URL, and their clients read
    PREFECT_API_URL once, when the worker starts. A test that points this process at another
    server (a real `prefect server` that its module stops) must not capture them: events queued
    for a server that is gone drain at about one per client timeout, the task-run states of every
    later flow never reach the session server, and the harness's teardown, which drains without
    a bound, hangs. Keyed by the session server's URL and started now, they stay bound to it.
    """
    from prefect.events.clients import PrefectEventsClient
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL

    EventsWorker.set_client_override(PrefectEventsClient, api_url=str(PREFECT_API_URL.value()))
    EventsWorker.instance()
    APILogWorker.instance()


def _release_workers() -> None:
    from prefect.events.worker import EventsWorker

    EventsWorker.set_client_override(None)


@pytest.fixture(scope="session")
def prefect_env(prefect_server) -> dict[str, str]:
    """Environment for a subprocess that must talk to the session's server."""
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ)
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    return env


@pytest.fixture(scope="session")
def s3_endpoint():
    """One moto S3 server (server mode, loopback) for the whole session."""
    from tests.helpers.s3 import moto_s3_server

    with moto_s3_server() as url:
        yield url


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_PREFECT_HOME, ignore_errors=True)
