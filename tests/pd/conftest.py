"""Fixtures for PD end-to-end tests: real prefill, decode, colocated and router processes on loopback (CPU).

One session-wide set is started in a single parallel batch: a colocated server (the reference) and, per
transfer backend, a prefill + decode pair behind its own router.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster_util import (NO_MOONCAKE, PDCluster, Proc, decode_server, free_port, mooncake_available,
                          prefill_server, router, server, start_all, stop_all)

CHUNK_SIZE = 32  # the prefill's --chunked-prefill-size: the ~100-token prompts are prefilled in chunks
# tcp pair: chunks of 16+ tokens push KV layer by layer during the forward, shorter ones after it; the mooncake
# pair keeps the default threshold (512), so every chunk there is pushed after its forward.
LAYERWISE_ARGS = {"tcp": ["--disaggregation-layerwise-min-tokens", "16"], "mooncake": []}


BACKENDS = ["tcp", pytest.param("mooncake", marks=pytest.mark.skipif(not mooncake_available(), reason=NO_MOONCAKE))]


@pytest.fixture(scope="session")
def other_model(tiny_models) -> str:
    """A different architecture: a decode server with it must be refused by the prefill's handshake."""
    return tiny_models["llama-tiny"]


@pytest.fixture(scope="session")
def session_servers(tiny_model) -> Iterator[dict]:
    backends = ["tcp"] + (["mooncake"] if mooncake_available() else [])
    colocated = server("colocated", tiny_model)
    pairs = {}
    for backend in backends:
        bootstrap = free_port()
        pairs[backend] = (prefill_server(tiny_model, backend, bootstrap, "--chunked-prefill-size", str(CHUNK_SIZE),
                                         *LAYERWISE_ARGS[backend]),
                          bootstrap, decode_server(tiny_model, backend))
    servers = [colocated, *(p for p, _, _ in pairs.values()), *(d for _, _, d in pairs.values())]
    start_all(servers)
    routers = {backend: router([(p, b)], [d], name=f"router-{backend}") for backend, (p, b, d) in pairs.items()}
    try:
        start_all(list(routers.values()))
    except BaseException:
        stop_all(servers)
        raise
    clusters = {backend: PDCluster(backend, p, b, d, routers[backend]) for backend, (p, b, d) in pairs.items()}
    yield {"colocated": colocated, "clusters": clusters}
    stop_all([*routers.values(), *servers])


@pytest.fixture(scope="session")
def colocated(session_servers) -> Proc:
    return session_servers["colocated"]


@pytest.fixture(params=BACKENDS)
def pd(request, session_servers) -> PDCluster:
    return session_servers["clusters"][request.param]


@pytest.fixture(scope="session")
def tcp_cluster(session_servers) -> PDCluster:
    return session_servers["clusters"]["tcp"]


@pytest.fixture(scope="session")
def offline_llm(tiny_model):
    from pdserve import LLM

    return LLM(tiny_model, device="cpu", max_total_tokens=4096, context_length=512)
