"""Each PD role served alone (`--disaggregation-transfer-backend fake`): real servers on the CPU, no peer, no
router, no bootstrap fields. The prefill answers with the first token only; the decode decodes the requested
tokens over a prompt KV nobody computed, and says so."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from cluster_util import MAX_TOTAL_TOKENS, Proc, decode_server, free_port, prefill_server, start_all, stop_all

from pdserve.server.generation import ROLE_ALONE_NOTES

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def alone(tiny_model) -> Iterator[dict[str, Proc]]:
    bootstrap_port = free_port()
    servers = {"prefill": prefill_server(tiny_model, "fake", bootstrap_port), "decode": decode_server(tiny_model, "fake")}
    start_all(list(servers.values()))
    servers["prefill"].bootstrap_port = bootstrap_port
    yield servers
    stop_all(list(servers.values()))


def generate(server: Proc, max_new_tokens: int, **body) -> dict:
    reply = server.post("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": max_new_tokens,
                                                                        "ignore_eos": True}, **body})
    assert reply.status == 200, reply.body
    return reply.json()


def completion(server: Proc, max_tokens: int) -> dict:
    model = server.get("/get_model_info").json()["served_model_name"]
    reply = server.post("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                            "ignore_eos": True})
    assert reply.status == 200, reply.body
    return reply.json()


def test_a_prefill_alone_answers_with_the_first_token_only(alone):
    prefill = alone["prefill"]
    result = generate(prefill, 8)
    assert len(result["output_ids"]) == 1 and result["meta_info"]["completion_tokens"] == 1
    assert result["meta_info"]["finish_reason"]["type"] == "length"
    assert {k: result["meta_info"][k] for k in ROLE_ALONE_NOTES["prefill"]} == ROLE_ALONE_NOTES["prefill"]
    openai = completion(prefill, 8)
    assert openai["usage"]["completion_tokens"] == 1 and openai["choices"][0]["finish_reason"] == "length"


def test_a_prefill_alone_ignores_bootstrap_fields_and_runs_no_bootstrap_server(alone):
    prefill = alone["prefill"]
    result = generate(prefill, 4, bootstrap_host="10.9.9.9", bootstrap_port=1, bootstrap_room=7)
    assert len(result["output_ids"]) == 1
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", prefill.bootstrap_port), timeout=2).close()
    assert "serves every request alone" in prefill.log()


def test_a_decode_alone_decodes_the_requested_tokens_and_says_the_kv_is_fake(alone):
    decode = alone["decode"]
    result = generate(decode, 6)
    assert len(result["output_ids"]) == 6 and result["meta_info"]["finish_reason"]["type"] == "length"
    assert result["meta_info"]["kv"] == "fake: prompt KV not computed"
    assert completion(decode, 5)["usage"]["completion_tokens"] == 5
    assert "prompt KV is not computed" in decode.log()


def test_a_decode_alone_queues_requests_until_their_pages_fit(alone):
    """Together the prompts need more pages than the pool holds: the later ones wait, none is refused."""
    prompt_len, count = 440, 10
    assert prompt_len * count > MAX_TOTAL_TOKENS
    prompts = [[(i * 31 + j) % 200 + 5 for j in range(prompt_len)] for i in range(count)]
    reply = alone["decode"].post("/generate", {"input_ids": prompts,
                                               "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    assert reply.status == 200, reply.body
    assert [len(r["output_ids"]) for r in reply.json()] == [3] * count


def test_both_roles_report_what_they_are(alone):
    for role, server in alone.items():
        info = server.get("/get_server_info").json()
        assert info["model_info"]["disaggregation_mode"] == role
        assert info["model_info"]["transfer_backend"] == "fake"
        assert info["disaggregation_transfer_backend"] == "fake"
