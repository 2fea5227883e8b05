"""Fixtures for server tests: the real server as a subprocess on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster_util import release_after_last_user
from server_util import ServerProcess, start_server


@pytest.fixture(scope="session")
def server(request, tiny_model, tmp_path_factory) -> Iterator[ServerProcess]:
    """One server for every module that uses it (tests/server/test_server.py has its own: its last test stops it);
    stopped after the last test that uses it."""
    proc = start_server(tiny_model, tmp_path_factory)
    stop = release_after_last_user(request, proc.stop)
    yield proc
    stop()
