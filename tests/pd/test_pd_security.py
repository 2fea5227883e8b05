"""A PD cluster with a cluster secret, as real processes (tcp): the router's requests are served and match the
colocated output even when a client supplies its own bootstrap fields; the same fields sent straight to a PD server
without the router's token are refused; the bootstrap server refuses an unsigned route hijack, also in a pair given
only an API key (the key is then the cluster secret)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from cluster_util import Proc, decode_server, free_port, http, prefill_server, router, start_all, stop_all, wait_kv_free

pytestmark = pytest.mark.timeout(900)

SECRET = ("--disaggregation-secret", "pd-security-test-secret")
PROMPT = "The capital of France is"


API_KEY = ("--api-key", "pd-security-test-key")
KEY_HEADER = {"Authorization": f"Bearer {API_KEY[1]}"}
HIJACK = {"rank": 0, "control_endpoint": "127.0.0.1:9", "transfer_session": "127.0.0.1:9", "transfer_backend": "tcp",
          "kv_layout": {}, "model": "x", "tp_size": 1}


def start_pd_pair(model: str, flags: tuple[str, ...], name: str) -> Iterator[tuple[Proc, int, Proc, Proc]]:
    """A tcp prefill + decode pair and its router, all given `flags`."""
    bootstrap = free_port()
    prefill = prefill_server(model, "tcp", bootstrap, *flags)
    decode = decode_server(model, "tcp", *flags, name=f"decode-{name}")
    start_all([prefill, decode])
    proc = router([(prefill, bootstrap)], [decode], *flags, name=f"router-{name}")
    try:
        start_all([proc])
    except BaseException:
        stop_all([prefill, decode])
        raise
    yield prefill, bootstrap, decode, proc
    stop_all([proc, prefill, decode])


@pytest.fixture(scope="module")
def secret_cluster(tiny_model) -> Iterator[tuple[Proc, int, Proc, Proc]]:
    yield from start_pd_pair(tiny_model, SECRET, "secret")


@pytest.fixture(scope="module")
def api_key_cluster(tiny_model) -> Iterator[tuple[Proc, int, Proc, Proc]]:
    """No cluster secret, only an API key: the key signs the internals too."""
    yield from start_pd_pair(tiny_model, API_KEY, "api-key")


def generate(proc: Proc, headers: dict | None = None, **fields):
    body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 8}, **fields}
    return proc.post("/generate", body, headers=headers)


def test_router_requests_are_served_and_client_bootstrap_fields_are_ignored(secret_cluster, colocated):
    prefill, _, decode, proc = secret_cluster
    expected = generate(colocated).json()["text"]
    reply = generate(proc, bootstrap_host="10.255.255.1", bootstrap_port=1, bootstrap_room=7)
    assert reply.status == 200, reply.body
    assert reply.json()["text"] == expected
    wait_kv_free([prefill, decode])


def test_bootstrap_fields_without_the_routers_token_are_refused(secret_cluster):
    prefill, bootstrap, decode, _ = secret_cluster
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": 99}
    for server in (prefill, decode):
        reply = generate(server, **fields)
        assert reply.status == 401 and "only from the router" in reply.json()["error"]["message"]
        forged = server.post("/generate", {"text": PROMPT, **fields}, headers={"X-PD-Auth": "1.0.ab.cd"})
        assert forged.status == 401
        assert server.get("/health").status == 200


def assert_route_hijack_is_refused(bootstrap: int) -> None:
    url = f"http://127.0.0.1:{bootstrap}/route"
    assert http("PUT", url, json.dumps(HIJACK).encode()).status == 401
    assert http("GET", url).status == 401


def test_unsigned_route_registration_is_refused(secret_cluster):
    _, bootstrap, _, proc = secret_cluster
    assert_route_hijack_is_refused(bootstrap)
    assert generate(proc).status == 200  # the route still points at the real prefill


def test_a_pd_pair_with_only_an_api_key_refuses_the_route_hijack(api_key_cluster):
    _, bootstrap, _, proc = api_key_cluster
    assert_route_hijack_is_refused(bootstrap)
    assert generate(proc, headers=KEY_HEADER).status == 200  # the router signs with the key
