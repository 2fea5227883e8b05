"""Fixtures for server tests: a tiny random model and the real server as a subprocess on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_util import API_KEY, ServerProcess

from pdserve.tools.make_model import make_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(make_model("qwen3-tiny", tmp_path_factory.mktemp("models") / "qwen3-tiny", seed=0))


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_model, api_key=API_KEY).start()
    yield proc
    proc.stop()
