"""Prefill, decode and router as three hosts with their own addresses (network namespaces on a bridge); the
test process talks to the router from the root namespace. Skipped only where `ip netns` is refused."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster_util import release_after_last_user, start_all, stop_all
from hosts import ROLES, HostCluster, host_cluster, mooncake_available
from netns import Network, clean_leftovers, netns_refusal

REFUSAL = netns_refusal()
if REFUSAL is not None:
    pytest.skip(f"multi-host tests need network namespaces: {REFUSAL}", allow_module_level=True)


@pytest.fixture(scope="session")
def network() -> Iterator[Network]:
    clean_leftovers()
    net = Network().create(ROLES)
    try:
        yield net
    finally:
        net.destroy()


@pytest.fixture(scope="session")
def clusters(request, network, tiny_model) -> Iterator[dict[str, HostCluster]]:
    """tcp with every role on its own address; mooncake likewise and with --host 0.0.0.0 everywhere. Stopped after
    the last test that uses them."""
    specs = {"tcp": ("tcp", False)}
    if mooncake_available():
        specs |= {"mooncake": ("mooncake", False), "wildcard": ("mooncake", True)}
    else:
        specs |= {"wildcard": ("tcp", True)}
    made = {name: host_cluster(network, tiny_model, backend, wildcard, 100 * i)
            for i, (name, (backend, wildcard)) in enumerate(specs.items())}
    servers = [p for c in made.values() for p in (c.prefill, c.decode)]
    start_all(servers)
    try:
        start_all([c.router for c in made.values()])
    except BaseException:
        stop_all(servers)
        raise
    stop = release_after_last_user(request, lambda: stop_all([p for c in made.values() for p in c.procs]))
    yield made
    stop()


@pytest.fixture(scope="session")
def offline_llm(tiny_model):
    """The colocated engine, in this process: the reference every PD answer must match token for token."""
    from pdserve import LLM

    return LLM(tiny_model, device="cpu", max_total_tokens=4096, context_length=512)
