"""`--local-prefill-by-load` through a router process, against stub servers whose `/load` the test sets: the router
keeps the remote prefill while the prefill queue is short, moves prompts to a decode instance when the queue is
long and the decode reports a budget, never to one without a budget or above the KV gate, books the prompts it
sends so that a burst between two polls stops going local once the decode's predicted wait passes the remote one,
sends a long document that collides with a busy prefill to a decode whose saved credit prefills it at full speed
(never two on one credit), and learns each path's overhead (remote: the handoff) from its own streamed requests."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from pdserve_router.cli import parse_config

PROMPT = {"text": "x" * 4000}  # 1,000 tokens by the router's estimate (bytes / 4)
IDLE_PREFILL = {"queued_prefill_tokens": 0, "prefill_tokens_per_s": 10_000.0}  # 0.1 s for the prompt
BUSY_PREFILL = {"queued_prefill_tokens": 100_000, "prefill_tokens_per_s": 1_000.0}  # 101 s
BUDGETED_DECODE = {"queued_prefill_tokens": 0, "prefill_tokens_per_s": 10_000.0, "local_prefill_tokens_per_s": 2_000.0,
                   "decode_step_ms": 5.0, "num_running_reqs": 1, "kv_usage": 0.1, "tpot_budget_ms": 10.0}  # 0.5 s


def by_load(*flags: str) -> tuple[str, ...]:
    return ("--local-prefill-by-load", "--load-poll-interval-s", "0.05", *flags)


def start(stubs, start_router, prefill_load: dict, decode_load: dict, *flags: str):
    prefill, decode = stubs.add("prefill", load=prefill_load), stubs.add("decode", load=decode_load)
    router = start_router("--prefill", prefill.url, "--decode", decode.url, *(flags or by_load()))
    return prefill, decode, router


def went_local(router, prefill, decode, body: dict = PROMPT) -> bool:
    before = len(prefill.requests)
    assert router.post("/generate", body).status == 200
    local = len(prefill.requests) == before
    assert ("bootstrap_room" in decode.requests[-1]["body"]) != local
    return local


def reported(router, worker, key: str, value) -> None:
    """Waits until the router has read `value` for `key` in the instance's /load (its /workers shows it)."""
    router.wait_for(lambda: router.workers()[worker.url].get("load", {}).get(key) == value)


def test_a_short_prefill_queue_keeps_the_remote_path(stubs, start_router):
    prefill, decode, router = start(stubs, start_router, IDLE_PREFILL, BUDGETED_DECODE)
    assert not any(went_local(router, prefill, decode) for _ in range(3))
    assert router.metric('pdserve_router_local_prefill_decisions_total{reason="remote_faster"}') == 3
    assert router.metric('pdserve_router_predicted_ttft_seconds_count{path="local"}') == 3


def test_a_long_prefill_queue_moves_prompts_to_a_decode_with_budget_only(stubs, start_router):
    prefill, decode, router = start(stubs, start_router, BUSY_PREFILL, BUDGETED_DECODE)
    assert all(went_local(router, prefill, decode) for _ in range(3))
    decode.load = {**BUDGETED_DECODE, "local_prefill_tokens_per_s": 0.0}  # no budget left for local prefill
    reported(router, decode, "local_prefill_tokens_per_s", 0.0)
    assert not went_local(router, prefill, decode)
    decode.load = {**BUDGETED_DECODE, "kv_usage": 0.95}  # budget, but KV above the gate (0.9)
    reported(router, decode, "kv_usage", 0.95)
    assert not went_local(router, prefill, decode)
    decode.load = {k: v for k, v in BUDGETED_DECODE.items() if k != "local_prefill_tokens_per_s"}  # an older server
    reported(router, decode, "kv_usage", 1.0)
    assert not went_local(router, prefill, decode)
    decode.load = BUDGETED_DECODE
    reported(router, decode, "kv_usage", 0.1)
    assert went_local(router, prefill, decode)
    decisions = "pdserve_router_local_prefill_decisions_total"
    assert router.metric(f'{decisions}{{reason="local_faster"}}') == 4
    assert router.metric(f'{decisions}{{reason="no_budget"}}') == 2
    assert router.metric(f'{decisions}{{reason="kv_gate"}}') == 1
    assert router.metric('pdserve_router_prefill_total{path="local"}') == 4
    router.terminate()  # the router logs a summary as it stops
    router.proc.wait(timeout=10)
    assert "--local-prefill-by-load choices: kv_gate 1, local_faster 4, no_budget 2; learned overheads" in router.log()


def test_the_decode_predicted_soonest_takes_the_prompt(stubs, start_router):
    prefill = stubs.add("prefill", load=BUSY_PREFILL)
    slow = stubs.add("decode", load={**BUDGETED_DECODE, "local_prefill_tokens_per_s": 500.0})
    full = stubs.add("decode", load={**BUDGETED_DECODE, "local_prefill_tokens_per_s": 9_000.0, "kv_usage": 0.97})
    fast = stubs.add("decode", load=BUDGETED_DECODE)
    router = start_router("--prefill", prefill.url, "--decode", slow.url, full.url, fast.url, *by_load())
    for _ in range(3):
        assert router.post("/generate", PROMPT).status == 200
    assert len(fast.requests) == 3 and not slow.requests and not full.requests and not prefill.requests


def test_bookings_stop_a_burst_between_two_polls_at_the_decodes_budget(stubs, start_router):
    """Remote: (40,000 queued + 1,000 per prompt booked there) at 10,000 tok/s = 4.1 s, 4.2 s, ...; local at the
    decode's budgeted 1,000 tok/s: 1 s, 2 s, 3 s, 4 s, then 5 s, which the remote path beats for the rest."""
    prefill = stubs.add("prefill", held=True, load={"queued_prefill_tokens": 40_000, "prefill_tokens_per_s": 1e4})
    decode = stubs.add("decode", held=True, load={**BUDGETED_DECODE, "local_prefill_tokens_per_s": 1_000.0})
    router = start_router("--prefill", prefill.url, "--decode", decode.url,
                          *by_load("--load-poll-interval-s", "600"))  # one poll, at the start: the burst is between
    burst = 12
    with ThreadPoolExecutor(burst) as pool:
        replies = [pool.submit(router.post, "/generate", PROMPT) for _ in range(burst)]
        router.wait_for(lambda: len(decode.requests) == burst, timeout=20)  # all dispatched, none answered yet
        stubs.release(prefill)
        stubs.release(decode)
        assert all(reply.result(timeout=30).status == 200 for reply in replies)
    local = sum("bootstrap_room" not in request["body"] for request in decode.requests)
    assert local == 4 and len(prefill.requests) == burst - 4
    assert router.metric('pdserve_router_prefill_total{path="local"}') == 4


DOC = {"text": "x" * 28_000}  # 7,000 tokens
COLLIDING_PREFILL = {"queued_prefill_tokens": 7_000, "prefill_tokens_per_s": 30_000.0}  # 0.467 s for the document
SAVED_CREDIT = {**BUDGETED_DECODE, "local_prefill_tokens_per_s": 10_000.0, "local_prefill_burst_s": 0.25,
                "extend_fixed_ms": 19.0, "extend_us_per_token": 30.0}  # the document in 0.229 s, else 0.7 s


def test_saved_credit_takes_a_colliding_document_local_and_none_leaves_it_remote(stubs, start_router):
    prefill, decode, router = start(stubs, start_router, COLLIDING_PREFILL, SAVED_CREDIT)
    reported(router, decode, "local_prefill_burst_s", 0.25)
    assert went_local(router, prefill, decode, DOC)
    decode.load = {**SAVED_CREDIT, "local_prefill_burst_s": 0.0}
    reported(router, decode, "local_prefill_burst_s", 0.0)
    assert not went_local(router, prefill, decode, DOC)


def test_two_documents_together_do_not_both_go_local_on_one_credit(stubs, start_router):
    prefill = stubs.add("prefill", held=True, load=COLLIDING_PREFILL)
    decode = stubs.add("decode", held=True, load=SAVED_CREDIT)
    router = start_router("--prefill", prefill.url, "--decode", decode.url,
                          *by_load("--load-poll-interval-s", "600"))  # one poll, at the start: both are between
    reported(router, decode, "local_prefill_burst_s", 0.25)
    with ThreadPoolExecutor(2) as pool:
        replies = [pool.submit(router.post, "/generate", DOC) for _ in range(2)]
        router.wait_for(lambda: len(decode.requests) == 2, timeout=20)  # both dispatched, none answered yet
        stubs.release(prefill)
        stubs.release(decode)
        assert all(reply.result(timeout=30).status == 200 for reply in replies)
    local = sum("bootstrap_room" not in request["body"] for request in decode.requests)
    assert local == 1 and len(prefill.requests) == 1


def test_the_remote_paths_handoff_is_learned_from_streamed_requests(stubs, start_router):
    """The decode answers its first byte 0.3 s after the (instant) prefill: once the router has seen that, the
    remote path's 0.001 s + 0.3 s loses to the decode's 0.2 s (its own overhead not learned yet)."""
    prefill = stubs.add("prefill", load={"queued_prefill_tokens": 0, "prefill_tokens_per_s": 1e6})
    decode = stubs.add("decode", delay_s=0.3, load={**BUDGETED_DECODE, "local_prefill_tokens_per_s": 5_000.0})
    router = start_router("--prefill", prefill.url, "--decode", decode.url, *by_load())
    remote, local = ('pdserve_router_learned_overhead_seconds{path="remote"}',
                     'pdserve_router_learned_overhead_seconds{path="local"}')
    assert router.metric(remote) == 0
    assert not went_local(router, prefill, decode, {**PROMPT, "stream": True})
    assert router.metric(remote) >= 0.29 and router.metric(local) == 0
    assert went_local(router, prefill, decode, {**PROMPT, "stream": True})
    assert router.metric(local) >= 0.09  # 0.3 s to the first byte, 0.2 s predicted


def test_flags_that_cannot_work_are_refused():
    assert parse_config(["--local-prefill-by-load"]).load_poll_roles() == ("prefill", "decode")
    assert parse_config(["--local-prefill-cost-factor", "2"]).load_poll_roles() == ("prefill",)
    assert parse_config([]).load_poll_roles() == ()
    for flags in (["--local-prefill-by-load", "--local-prefill-max-tokens", "64"],
                  ["--local-prefill-by-load", "--local-prefill-cost-factor", "2"],
                  ["--local-prefill-alpha", "0"], ["--local-prefill-alpha", "nan"], ["--local-prefill-alpha", "inf"],
                  ["--local-prefill-kv-gate", "1.5"], ["--local-prefill-kv-gate", "0"]):
        with pytest.raises(SystemExit):
            parse_config(flags)


def test_text_prompts_are_sized_in_the_servers_tokens(stubs, start_router):
    """4,000 bytes: 1,000 tokens at the first guess (remote 0.2 s < local 0.25 s); the answer says 500 (8 bytes a
    token), after which local 0.125 s beats remote 0.15 s."""
    prefill = stubs.add("prefill", text_bytes_per_token=8.0,
                        load={"queued_prefill_tokens": 1_000, "prefill_tokens_per_s": 10_000.0})
    decode = stubs.add("decode", text_bytes_per_token=8.0,
                       load={**BUDGETED_DECODE, "local_prefill_tokens_per_s": 4_000.0})
    router = start_router("--prefill", prefill.url, "--decode", decode.url, *by_load())
    assert router.metric("pdserve_router_prompt_bytes_per_token") == 4
    assert not went_local(router, prefill, decode)
    assert router.metric("pdserve_router_prompt_bytes_per_token") == 8
    assert went_local(router, prefill, decode)
    assert went_local(router, prefill, decode, {"input_ids": list(range(500))})  # token ids count themselves
