"""Fixtures for the benchmark tests: the tiny model (its tokenizer builds exact-length prompts) and, for the
end-to-end tests, a colocated server and a tcp PD pair behind a router, all started in one parallel batch."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster_util import PDCluster, decode_server, free_port, prefill_server, router, server, start_all, stop_all


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
