"""Fixtures for server tests: the real server as a subprocess on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_util import API_KEY, ServerProcess, api_server


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[ServerProcess]:
    proc = api_server(tiny_model, tmp_path_factory.mktemp("server") / "server.log", api_key=API_KEY).start()
    yield proc
    proc.stop()
