"""Conditional disaggregation's routing decision: short prompts and saturated prefills go local, the rest remote;
through a router process, the prefill's `/load` switches the path."""

from __future__ import annotations

import time

import pytest
from pdserve_router.conditional import InstanceLoad, LocalPrefillRule, estimate_prompt_tokens, parse_load

IDLE = InstanceLoad(queued_tokens=0, tokens_per_s=10_000.0)


def test_short_prompt_goes_local_and_long_goes_remote():
    rule = LocalPrefillRule(max_tokens=256)
    assert rule.prefill_locally(256, [IDLE])
    assert not rule.prefill_locally(257, [IDLE])
    assert not rule.prefill_locally(4000, [InstanceLoad(10**6, 100.0)])  # no cost factor: load is not read


def test_saturated_prefill_sends_long_prompts_local():
    rule = LocalPrefillRule(max_tokens=0, cost_factor=2.0)
    # 1,000 tokens at 10k tok/s: 0.1 s remote when idle, 0.2 s local
    assert not rule.prefill_locally(1000, [IDLE])
    assert not rule.prefill_locally(1000, [InstanceLoad(999, 10_000.0)])  # waits 0.1999 s < 0.2 s
    assert rule.prefill_locally(1000, [InstanceLoad(1001, 10_000.0)])  # waits 0.2001 s > 0.2 s
    assert rule.prefill_locally(1000, [InstanceLoad(50_000, 10_000.0), InstanceLoad(60_000, 20_000.0)])


def test_one_idle_prefill_keeps_the_remote_path():
    rule = LocalPrefillRule(cost_factor=2.0)
    assert not rule.prefill_locally(1000, [InstanceLoad(50_000, 10_000.0), IDLE])


def test_unknown_load_or_prompt_keeps_the_remote_path():
    rule = LocalPrefillRule(max_tokens=64, cost_factor=2.0)
    assert not rule.prefill_locally(1000, [None])  # the instance did not answer /load
    assert not rule.prefill_locally(1000, [InstanceLoad(10**6, 0.0)])  # no prefill measured yet
    assert not rule.prefill_locally(1000, [])
    assert not rule.prefill_locally(None, [InstanceLoad(10**6, 1.0)])


def test_rule_is_off_by_default():
    rule = LocalPrefillRule()
    assert not rule.enabled
    assert not rule.prefill_locally(1, [InstanceLoad(10**6, 1.0)])


def test_prompt_token_estimate():
    assert estimate_prompt_tokens([5, 6, 7]) == 3
    assert estimate_prompt_tokens("abcd" * 10) == 10
    assert estimate_prompt_tokens("abcde") == 2
    assert estimate_prompt_tokens("é") == 1  # bytes, not characters
    assert estimate_prompt_tokens(None) is None


@pytest.mark.parametrize("body", [None, [], {}, {"queued_prefill_tokens": -1, "prefill_tokens_per_s": 1.0},
                                  {"queued_prefill_tokens": 1.5, "prefill_tokens_per_s": 1.0},
                                  {"queued_prefill_tokens": True, "prefill_tokens_per_s": 1.0},
                                  {"queued_prefill_tokens": 1, "prefill_tokens_per_s": "fast"},
                                  {"queued_prefill_tokens": 1, "prefill_tokens_per_s": float("nan")},
                                  {"queued_prefill_tokens": 1, "prefill_tokens_per_s": float("inf")}])
def test_malformed_load_answers_are_ignored(body):
    assert parse_load(body) is None


def test_load_answer_parsed():
    assert parse_load({"queued_prefill_tokens": 12, "prefill_tokens_per_s": 300, "num_waiting": 1}) == \
        InstanceLoad(12, 300.0)


def test_router_spills_to_the_decode_while_the_prefill_reports_a_long_queue(stubs, start_router):
    prefill = stubs.add("prefill", load={"queued_prefill_tokens": 100_000, "prefill_tokens_per_s": 1000.0})
    decode = stubs.add("decode")
    router = start_router("--prefill", prefill.url, "--decode", decode.url, "--local-prefill-cost-factor", "2",
                          "--load-poll-interval-s", "0.05")
    body = {"text": "x" * 400}  # ~100 tokens: 100 s behind the queue, 0.2 s locally
    until_path(router, prefill, body, local=True)
    assert "bootstrap_room" not in decode.requests[-1]["body"]
    prefill.load = {"queued_prefill_tokens": 0, "prefill_tokens_per_s": 1000.0}
    until_path(router, prefill, body, local=False)
    assert decode.requests[-1]["body"]["bootstrap_room"] == prefill.requests[-1]["body"]["bootstrap_room"]
    assert router.metric('pdserve_router_prefill_total{path="local"}') >= 1
    assert router.metric('pdserve_router_prefill_total{path="remote"}') >= 1


def until_path(router, prefill, body: dict, local: bool, timeout: float = 10.0) -> None:
    """Sends `body` until the router takes the local (or remote) path: the poller's next read switches it."""
    deadline = time.monotonic() + timeout
    while True:
        before = len(prefill.requests)
        assert router.post("/generate", body).status == 200
        if (len(prefill.requests) == before) == local:
            return
        assert time.monotonic() < deadline, f"the router never took the {'local' if local else 'remote'} path"
        time.sleep(0.05)
