"""The release-flow tests' real Prefect server, one per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.prefect_server import PrefectServer, prefect_server_process


@pytest.fixture(scope="module")
def real_server(tmp_path_factory) -> Iterator[PrefectServer]:
    with prefect_server_process(tmp_path_factory.mktemp("prefect-home")) as server:
        yield server
