"""The router owns the PD rendezvous: it never forwards a client's bootstrap fields, and with a cluster secret it
signs what it sends to PD servers."""

from __future__ import annotations

from pdserve.cluster_auth import HEADER

CLIENT_FIELDS = {"bootstrap_host": "10.255.255.1", "bootstrap_port": 1, "bootstrap_room": 7}


def test_client_bootstrap_fields_never_reach_a_regular_worker(stubs, start_router):
    worker = stubs.add("regular")
    router = start_router("--worker", worker.url)
    for path, body in (("/generate", {"text": "hi"}), ("/v1/completions", {"prompt": "hi", "model": "m"})):
        assert router.post(path, {**body, **CLIENT_FIELDS}).status == 200
        assert not set(CLIENT_FIELDS) & set(worker.requests[-1]["body"])


def test_pd_requests_carry_a_fresh_cluster_token_and_the_routers_own_room(stubs, start_router):
    prefill, decode = stubs.add("prefill"), stubs.add("decode")
    router = start_router("--prefill", prefill.url, "--decode", decode.url, "--disaggregation-secret", "s3cret")
    tokens = set()
    for _ in range(2):
        assert router.post("/generate", {"text": "hi", **CLIENT_FIELDS}).status == 200
        body = decode.requests[-1]["body"]
        assert body["bootstrap_room"] != 7 and body["bootstrap_host"] == "127.0.0.1"
        token = decode.requests[-1]["headers"][HEADER.lower()]
        assert prefill.requests[-1]["headers"][HEADER.lower()] == token and len(token.split(".")) == 4
        tokens.add(token)
    assert len(tokens) == 2


def test_without_a_secret_no_token_is_sent(stubs, start_router):
    prefill, decode = stubs.add("prefill"), stubs.add("decode")
    router = start_router("--prefill", prefill.url, "--decode", decode.url)
    assert router.post("/generate", {"text": "hi"}).status == 200
    assert HEADER.lower() not in decode.requests[-1]["headers"]


def test_requests_a_decode_instance_prefills_itself_are_signed_too(stubs, start_router):
    prefill, decode = stubs.add("prefill"), stubs.add("decode")
    router = start_router("--prefill", prefill.url, "--decode", decode.url, "--disaggregation-secret", "s3cret",
                          "--local-prefill-max-tokens", "64")
    for body in ({"text": "hi"}, {"text": "hi", "sampling_params": {"max_new_tokens": 0}}):  # local, prompt-only
        assert router.post("/generate", body).status == 200
        sent = decode.requests[-1]
        assert "bootstrap_room" not in sent["body"] and len(sent["headers"][HEADER.lower()].split(".")) == 4
    assert not prefill.requests
