"""Fixtures for PD end-to-end tests: real prefill, decode, colocated and router processes on loopback (CPU).

The session's shared servers (tests/conftest.py `shared_servers`: a colocated server, the reference, and a tcp
prefill + decode pair behind its router) and, where mooncake imports, a mooncake pair behind its own router.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster_util import (NO_MOONCAKE, SHARED_CHUNK_SIZE, STAGING_WAIT_ARGS, PDCluster, Proc, decode_server,
                          free_port, mooncake_available, prefill_server, release_after_last_user, router,
                          start_with_router, stop_all)

CHUNK_SIZE = SHARED_CHUNK_SIZE  # the prefills' --chunked-prefill-size: the ~100-token prompts are prefilled in chunks
# tcp pair (shared_servers): chunks of 16+ tokens push KV layer by layer during the forward, shorter ones after it;
# the mooncake pair keeps the default threshold (512), so every chunk there is pushed after its forward.


BACKENDS = ["tcp", pytest.param("mooncake", marks=pytest.mark.skipif(not mooncake_available(), reason=NO_MOONCAKE))]


@pytest.fixture(scope="session")
def other_model(tiny_models) -> str:
    """A different architecture: a decode server with it must be refused by the prefill's handshake."""
    return tiny_models["llama-tiny"]


@pytest.fixture(scope="session")
def mooncake_cluster(request, tiny_model) -> Iterator[PDCluster | None]:
    """The mooncake pair behind its own router; None where mooncake cannot be imported."""
    if not mooncake_available():
        yield None
        return
    bootstrap = free_port()
    prefill = prefill_server(tiny_model, "mooncake", bootstrap, "--chunked-prefill-size", str(CHUNK_SIZE),
                             *STAGING_WAIT_ARGS)
    decode = decode_server(tiny_model, "mooncake")
    servers = [prefill, decode]
    front = start_with_router(servers, lambda: router([(prefill, bootstrap)], [decode], name="router-mooncake"))
    stop = release_after_last_user(request, lambda: stop_all([front, *servers]))
    yield PDCluster("mooncake", prefill, bootstrap, decode, front)
    stop()


@pytest.fixture(scope="session")
def session_servers(shared_servers, mooncake_cluster) -> dict:
    clusters = {"tcp": shared_servers["tcp"]}
    if mooncake_cluster is not None:
        clusters["mooncake"] = mooncake_cluster
    return {"colocated": shared_servers["colocated"], "clusters": clusters}


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
