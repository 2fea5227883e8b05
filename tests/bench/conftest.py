"""Fixtures for the benchmark tests: the tiny model (its tokenizer builds exact-length prompts) and, for the
end-to-end tests, a colocated server and a tcp PD pair behind a router, all started in one parallel batch."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster_util import (PDCluster, decode_server, free_port, prefill_server, router, server,  # noqa: E402
                          start_all, stop_all)

from pdserve.tools.make_model import make_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(make_model("qwen3-tiny", tmp_path_factory.mktemp("models") / "qwen3-tiny", seed=0))


@pytest.fixture(scope="session")
def deployments(tiny_model) -> Iterator[dict]:
    colocated = server("colocated", tiny_model)
    bootstrap = free_port()
    prefill = prefill_server(tiny_model, "tcp", bootstrap)
    decode = decode_server(tiny_model, "tcp")
    servers = start_all([colocated, prefill, decode])
    try:
        pd_router = start_all([router([(prefill, bootstrap)], [decode])])[0]
    except BaseException:
        stop_all(servers)
        raise
    yield {"colocated": colocated, "pd": PDCluster("tcp", prefill, bootstrap, decode, pd_router)}
    stop_all([pd_router, *servers])
