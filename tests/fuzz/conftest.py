"""Fixtures for the fuzz suite: one colocated server and one tcp prefill + decode pair behind a router, real
processes on loopback, shared by every fuzz test of the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster_util import Proc, decode_server, free_port, prefill_server, router, server, start_all, stop_all
from fuzz_util import Targets, generate_greedy

MAX_BATCH_ITEMS = 4096  # large batches, so that tokenizing one takes seconds (tests/fuzz/test_event_loop.py)


@pytest.fixture(scope="session")
def targets(tiny_model) -> Iterator[Targets]:
    bootstrap = free_port()
    colocated = server("colocated", tiny_model, "--max-batch-items", str(MAX_BATCH_ITEMS))
    prefill, decode = prefill_server(tiny_model, "tcp", bootstrap), decode_server(tiny_model, "tcp")
    servers: list[Proc] = [colocated, prefill, decode]
    start_all(servers)
    pd_router = router([(prefill, bootstrap)], [decode])
    try:
        start_all([pd_router])
    except BaseException:
        stop_all(servers)
        raise
    reference = generate_greedy(colocated)["text"]  # before any abuse
    yield Targets(colocated, prefill, decode, pd_router, reference)
    stop_all([pd_router, *servers])

