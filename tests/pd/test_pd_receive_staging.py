"""Receive staging, on by default, end to end in real PD servers on the CPU (router, prefill, decode processes):
every handoff of a default decode is staged, over tcp and mooncake, and a staged request whose pages lie scattered in
the decode's pool decodes as colocated; pools and staging slots are free afterwards."""

from __future__ import annotations

import random

import pytest
from cluster_util import (PD_TIMEOUTS, STAGING_WAIT_ARGS, PDCluster, Proc, decode_server, free_port, router,
                          scheduler_stats, server, start_with_router, stop_all, wait_kv_free)

from pdserve import server_processes

pytestmark = pytest.mark.timeout(900)  # the first test also pays for starting the servers

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def staging(proc: Proc) -> dict:
    return scheduler_stats(proc)["receive_staging"]


def output_ids(proc: Proc, input_ids: list[int], max_new_tokens: int = 6) -> list[int]:
    reply = proc.post("/generate", {"input_ids": input_ids, "sampling_params": {**GREEDY,
                                                                                 "max_new_tokens": max_new_tokens}})
    assert reply.status == 200, reply.body
    return reply.json()["output_ids"]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 900) for _ in range(n)]


def test_a_default_decode_stages_every_handoff(pd: PDCluster, colocated: Proc):
    """No staging flag on the session's decode servers; prompts of one page to several chunks (the tcp pair pushes
    chunks layer by layer into the slot)."""
    before = staging(pd.decode)
    assert before is not None and before["bytes"] > 0
    prompts = [prompt(n, seed=n) for n in (5, 40, 100)]
    for ids in prompts:
        assert output_ids(pd.router, ids) == output_ids(colocated, ids)
    wait_kv_free([*pd.servers, colocated])
    after = staging(pd.decode)
    assert after["staged"] - before["staged"] == len(prompts)
    assert after["missed"] == before["missed"] and after["slots"] == 0


@pytest.fixture(scope="module")
def fragmenting_pair(tiny_model):
    """A tcp pair whose decode has 16 pages of 16 tokens and keeps finished prompts in its radix cache, so that its
    cache, evicted oldest first, leaves holes between the pages it still holds."""
    bootstrap = free_port()
    prefill = server("prefill-fragmenting", tiny_model, *server_processes.prefill_flags("tcp", bootstrap), *PD_TIMEOUTS,
                     *STAGING_WAIT_ARGS)
    decode = decode_server(tiny_model, "tcp", "--max-total-tokens", "256", "--num-reserved-decode-tokens", "16",
                           "--disaggregation-decode-enable-radix-cache", name="decode-fragmenting")
    front = start_with_router([prefill, decode], lambda: router(
        [(prefill, bootstrap)], [decode], name="router-fragmenting"))
    yield PDCluster("tcp", prefill, bootstrap, decode, front)
    stop_all([front, prefill, decode])


def test_a_staged_request_into_scattered_decode_pages_equals_colocated(fragmenting_pair: PDCluster, colocated: Proc):
    """Two 60-token prompts leave three full pages each in the decode's radix cache (pages 1-3 and 4-6); an
    11-page prompt then finds 10 free pages at the tail, evicts from the older prompt and takes the tail plus a page
    in front of the newer one: two runs apart, unpacked from one slot."""
    pd = fragmenting_pair
    before = staging(pd.decode)
    for seed in (1, 2):
        ids = prompt(60, seed)
        assert output_ids(pd.router, ids, max_new_tokens=2) == output_ids(colocated, ids, max_new_tokens=2)
    long_ids = prompt(170, seed=3)
    assert output_ids(pd.router, long_ids) == output_ids(colocated, long_ids)
    wait_kv_free([*pd.servers, colocated])
    after = staging(pd.decode)
    assert after["staged"] - before["staged"] == 3 and after["missed"] == before["missed"]
    assert after["scattered"] - before["scattered"] >= 1, after
    assert after["slots"] == 0
