"""The load-aware local-prefill rule (`--local-prefill-by-load`) as a function of the reported loads: predicted time
to first token on the best prefill (queue, booked tokens and prompt at its measured rate, plus the learned handoff)
against the best decode instance's (the same at its budgeted local rate, plus its learned overhead), gated by
budget and KV usage; a decode's saved credit (burst) prefilling at full speed the tokens it pays for, shared by the
bookings; a learned overhead's moving average; bookings that a later report shows stop counting; `/load` parsed
defensively."""

from __future__ import annotations

import pytest
from pdserve_router.conditional import (FASTER, INGEST_MARGIN_S, KV_GATE, NO_BUDGET, SLOWER, UNMEASURED,
                                        BookedTokens, InstanceLoad, LearnedOverhead, LoadAwareRule, Option,
                                        PromptSizer, parse_load, reported_prompt_tokens)

PROMPT = 1000
FAST_PREFILL = Option(InstanceLoad(0, 10_000.0))  # 0.1 s for the prompt
BUSY_PREFILL = Option(InstanceLoad(50_000, 10_000.0))  # 5.1 s for the prompt
BUDGETED_DECODE = Option(InstanceLoad(0, 10_000.0, local_tokens_per_s=2_000.0, kv_usage=0.1))  # 0.5 s locally
RULE = LoadAwareRule()


def test_a_short_prefill_queue_keeps_the_remote_path():
    decision = RULE.decide(PROMPT, [FAST_PREFILL], [BUDGETED_DECODE], remote_overhead_s=0.0)
    assert decision.decode is None and decision.reason == SLOWER
    assert decision.remote_s == pytest.approx(0.1) and decision.local_s == pytest.approx(0.5)


def test_a_long_prefill_queue_moves_the_prompt_to_a_budgeted_decode():
    decision = RULE.decide(PROMPT, [BUSY_PREFILL], [BUDGETED_DECODE], remote_overhead_s=0.0)
    assert decision.decode == 0 and decision.reason == FASTER


def test_the_best_prefill_instance_sets_the_remote_prediction():
    assert RULE.decide(PROMPT, [BUSY_PREFILL, FAST_PREFILL], [BUDGETED_DECODE], 0.0).decode is None


def test_the_learned_overheads_count_on_their_sides():
    assert RULE.decide(PROMPT, [FAST_PREFILL], [BUDGETED_DECODE], remote_overhead_s=0.39).decode is None  # 0.49 < 0.5
    decision = RULE.decide(PROMPT, [FAST_PREFILL], [BUDGETED_DECODE], remote_overhead_s=0.41)
    assert decision.decode == 0 and decision.remote_s == pytest.approx(0.51)
    decision = RULE.decide(PROMPT, [FAST_PREFILL], [BUDGETED_DECODE], remote_overhead_s=0.41, local_overhead_s=0.02)
    assert decision.decode is None and decision.local_s == pytest.approx(0.52)


def test_alpha_scales_the_comparison():
    assert LoadAwareRule(alpha=4.9).decide(PROMPT, [FAST_PREFILL], [BUDGETED_DECODE], 0.0).decode is None
    assert LoadAwareRule(alpha=5.1).decide(PROMPT, [FAST_PREFILL], [BUDGETED_DECODE], 0.0).decode == 0
    assert LoadAwareRule(alpha=0.05).decide(PROMPT, [BUSY_PREFILL], [BUDGETED_DECODE], 0.0).decode is None


@pytest.mark.parametrize("decode", [Option(InstanceLoad(0, 10_000.0)),  # reports no local rate
                                    Option(InstanceLoad(0, 10_000.0, local_tokens_per_s=0.0, kv_usage=0.0)),
                                    Option(None)])  # did not answer /load
def test_a_decode_without_budget_never_prefills(decode):
    decision = RULE.decide(PROMPT, [BUSY_PREFILL], [decode], 0.0)
    assert decision.decode is None and decision.reason == NO_BUDGET and decision.local_s is None


@pytest.mark.parametrize("kv_usage", [0.9, 0.95, 1.0])
def test_a_decode_at_or_above_the_kv_gate_never_prefills(kv_usage):
    decode = Option(InstanceLoad(0, 10_000.0, local_tokens_per_s=2_000.0, kv_usage=kv_usage))
    decision = RULE.decide(PROMPT, [BUSY_PREFILL], [decode], 0.0)
    assert decision.decode is None and decision.reason == KV_GATE
    assert LoadAwareRule(kv_gate=1.0).decide(PROMPT, [BUSY_PREFILL], [decode], 0.0).decode == \
        (None if kv_usage == 1.0 else 0)


def test_an_unmeasured_prefill_keeps_the_remote_path():
    for prefills in ([Option(InstanceLoad(10**6, 0.0))], [BUSY_PREFILL, Option(None)], []):
        decision = RULE.decide(PROMPT, prefills, [BUDGETED_DECODE], 0.0)
        assert decision.decode is None and decision.reason == UNMEASURED


def test_the_decode_predicted_soonest_is_chosen():
    slow = Option(InstanceLoad(0, 10_000.0, local_tokens_per_s=1_000.0, kv_usage=0.1))  # 1.0 s
    queued = Option(InstanceLoad(4_000, 10_000.0, local_tokens_per_s=4_000.0, kv_usage=0.1))  # 1.25 s
    fast_but_full = Option(InstanceLoad(0, 10_000.0, local_tokens_per_s=8_000.0, kv_usage=0.95))
    decision = RULE.decide(PROMPT, [BUSY_PREFILL], [queued, fast_but_full, slow, BUDGETED_DECODE], 0.0)
    assert decision.decode == 3 and decision.local_s == pytest.approx(0.5)
    assert RULE.decide(PROMPT, [BUSY_PREFILL], [queued, fast_but_full, slow], 0.0).decode == 2


def test_booked_tokens_count_on_both_sides():
    booked_decode = Option(BUDGETED_DECODE.load, booked_tokens=25_000)  # 13 s locally
    assert RULE.decide(PROMPT, [BUSY_PREFILL], [booked_decode], 0.0).decode is None
    booked_prefill = Option(FAST_PREFILL.load, booked_tokens=9_000)  # 1.0 s remotely
    assert RULE.decide(PROMPT, [booked_prefill], [BUDGETED_DECODE], 0.0).decode == 0


def test_a_learned_overhead_is_a_clipped_moving_average_of_the_observed_excess():
    estimate = LearnedOverhead()
    assert estimate.value == 0.0  # nothing learned: the path pays no overhead yet
    estimate.observe(first_byte_s=0.5, predicted_wait_s=0.2)
    assert estimate.value == pytest.approx(0.3)  # the first observation sets it
    estimate.observe(first_byte_s=1.5, predicted_wait_s=0.2)
    assert estimate.value == pytest.approx(0.3 + 0.1 * (1.3 - 0.3))
    for _ in range(200):
        estimate.observe(first_byte_s=0.0, predicted_wait_s=2.0)  # the prediction overestimates the wait
    assert estimate.seconds.value < 0 and estimate.value == 0.0
    estimate.observe(first_byte_s=1e9, predicted_wait_s=0.0)  # a stalled request moves it by a bounded step
    assert estimate.value < 10


def test_a_booking_counts_until_released_or_shown_by_a_later_report():
    booked = BookedTokens()
    first = booked.book(100, now=10.0)
    booked.book(40, now=10.2)
    assert booked.unseen(report_asked_at=9.9) == 140
    assert booked.unseen(report_asked_at=10.0 + INGEST_MARGIN_S / 2) == 140  # the server may not have queued it
    assert booked.unseen(report_asked_at=10.0 + INGEST_MARGIN_S * 2) == 40
    booked.release(first)
    booked.release(first)  # releasing twice (first byte, then the attempt's end) is harmless
    assert booked.unseen(report_asked_at=0.0) == 40


# the mix's collision: a 7,000-token document while the prefill instance computes another (30,000 tok/s there)
DOC = 7000
COLLIDING_PREFILL = Option(InstanceLoad(7000, 30_000.0))  # 0.467 s
EXTEND_LINE = dict(extend_fixed_s=0.019, extend_s_per_token=30e-6)  # 7,000 tokens in 0.229 s at full speed


def decode_with_credit(burst_s: float) -> InstanceLoad:
    return InstanceLoad(0, 30_000.0, local_tokens_per_s=10_000.0, kv_usage=0.1, burst_s=burst_s, **EXTEND_LINE)


def test_saved_credit_takes_a_colliding_document_local_and_no_credit_leaves_it_remote():
    decision = RULE.decide(DOC, [COLLIDING_PREFILL], [Option(decode_with_credit(0.25))], 0.0)
    assert decision.decode == 0 and decision.local_s == pytest.approx(0.019 + 0.21)
    decision = RULE.decide(DOC, [COLLIDING_PREFILL], [Option(decode_with_credit(0.0))], 0.0)
    assert decision.decode is None and decision.local_s == pytest.approx(0.7)  # all at the budgeted rate


def test_the_tokens_beyond_the_credit_go_at_the_budgeted_rate():
    load = decode_with_credit(0.1)  # (0.1 - 0.019) / 30 us = 2,700 tokens at full speed
    assert load.burst_tokens(DOC) == 2700 and load.burst_tokens(1000) == 1000
    assert load.local_wait_s(DOC) == pytest.approx(0.1 + 4300 / 10_000)
    assert decode_with_credit(0.01).local_wait_s(DOC) == pytest.approx(0.7)  # credit below the fixed cost: none


def test_bookings_share_one_burst():
    """The first document books 7,000 tokens on the decode; the second one's local wait counts them first, so the
    credit pays for them and the second waits at the budgeted rate: remote wins."""
    decode = decode_with_credit(0.25)
    assert RULE.decide(DOC, [COLLIDING_PREFILL], [Option(decode)], 0.0).decode == 0
    decision = RULE.decide(DOC, [COLLIDING_PREFILL], [Option(decode, booked_tokens=DOC)], 0.0)
    assert decision.decode is None and decision.local_s == pytest.approx(0.25 + 6300 / 10_000)


def test_full_load_answer_parsed():
    body = {"queued_prefill_tokens": 12, "prefill_tokens_per_s": 300.0, "local_prefill_tokens_per_s": 150,
            "decode_step_ms": 6.1, "num_running_reqs": 3, "kv_usage": 0.25, "tpot_budget_ms": 10.0}
    assert parse_load(body) == InstanceLoad(12, 300.0, 150.0, 0.25)
    burst = {"local_prefill_burst_s": 0.2, "extend_fixed_ms": 19.0, "extend_us_per_token": 30.0}
    assert parse_load({**body, **burst}) == InstanceLoad(12, 300.0, 150.0, 0.25, 0.2, 0.019, 30e-6)


@pytest.mark.parametrize("bad", [{"local_prefill_burst_s": -0.1}, {"local_prefill_burst_s": float("nan")},
                                 {"extend_fixed_ms": None}, {"extend_us_per_token": "30"}])
def test_a_load_without_a_valid_burst_has_none(bad):
    burst = {"local_prefill_burst_s": 0.2, "extend_fixed_ms": 19.0, "extend_us_per_token": 30.0, **bad}
    load = parse_load({"queued_prefill_tokens": 5, "prefill_tokens_per_s": 300.0, "local_prefill_tokens_per_s": 100.0,
                       "kv_usage": 0.1, **burst})
    assert load == InstanceLoad(5, 300.0, 100.0, 0.1) and load.burst_tokens(1000) == 0


@pytest.mark.parametrize("extra", [{}, {"local_prefill_tokens_per_s": 100.0},  # no kv_usage: no local prefill
                                   {"local_prefill_tokens_per_s": -1.0, "kv_usage": 0.1},
                                   {"local_prefill_tokens_per_s": True, "kv_usage": 0.1},
                                   {"local_prefill_tokens_per_s": float("inf"), "kv_usage": 0.1},
                                   {"local_prefill_tokens_per_s": "1", "kv_usage": 0.1},
                                   {"local_prefill_tokens_per_s": 100.0, "kv_usage": 1.5},
                                   {"local_prefill_tokens_per_s": 100.0, "kv_usage": -0.1},
                                   {"local_prefill_tokens_per_s": 100.0, "kv_usage": None}])
def test_a_load_without_a_valid_budget_takes_no_local_prefill(extra):
    load = parse_load({"queued_prefill_tokens": 5, "prefill_tokens_per_s": 300.0, **extra})
    assert load == InstanceLoad(5, 300.0) and load.local_tokens_per_s == 0.0


def test_an_absurd_queue_is_not_believed():
    assert parse_load({"queued_prefill_tokens": 1 << 41, "prefill_tokens_per_s": 1.0}) is None


def test_text_prompts_are_sized_at_the_bytes_per_token_the_servers_count():
    sizer = PromptSizer()
    assert sizer.tokens("x" * 4000) == 1000 and sizer.tokens([1, 2, 3]) == 3  # 4 bytes a token until told
    sizer.observe(4000, b'{"text": "a", "meta_info": {"prompt_tokens": 500}}', stream=False)
    assert sizer.tokens("x" * 4000) == 500
    sizer.observe(4000, b'data: {"text": "a", "meta_info": {"prompt_tokens": 1000}}\n\ndata: {"te', stream=True)
    assert sizer.bytes_per_token.value == pytest.approx(8 + 0.1 * (4 - 8))
    sizer.observe(10**9, b'{"meta_info": {"prompt_tokens": 1}}', stream=False)  # clipped to 32 bytes a token
    assert sizer.bytes_per_token.value == pytest.approx(7.6 + 0.1 * (32 - 7.6))


@pytest.mark.parametrize(("answer", "stream"), [(b"", False), (b"[]", False), (b"{not json", False),
                                                (b'{"meta_info": {"prompt_tokens": 0}}', False),
                                                (b'{"meta_info": {"prompt_tokens": 2.5}}', False),
                                                (b'{"meta_info": {"prompt_tokens": true}}', False),
                                                (b'{"meta_info": {"prompt_tokens": 2000000000}}', False),
                                                (b'{"meta_info": []}', False),
                                                (b'{"meta_info": {"prompt_tokens": 9}}', True),  # not an event
                                                (b'data: [DONE]\n\n', True), (b"[" * 100_000, False)])
def test_answers_without_a_plausible_prompt_count_teach_nothing(answer, stream):
    assert reported_prompt_tokens(answer, stream) is None
    sizer = PromptSizer()
    sizer.observe(4000, answer, stream)
    assert sizer.bytes_per_token.samples == 0
