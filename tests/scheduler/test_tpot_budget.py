"""The TPOT budget's credit controller and step-cost model, with step times given by the test: chunk sizing,
credit accounting (earn, spend, settle, cap, debt), full speed with nothing decoding, the rates `/load` offers, and
saved credit (bursts) guarded per running request, down to a simulated mix of joins, leaves and prompts."""

from __future__ import annotations

import pytest

from pdserve.config import ConfigError, ServerArgs
from pdserve.scheduler.tpot_budget import (CREDIT_CAP_BUDGETS, MIN_EARN_SHARE, SAVED_CHUNK_TOKENS, StepCosts,
                                          TpotBudget)

PAGE = 16
MAX_CHUNK = 8192
MS = 1e-3
FIXED_S, PER_TOKEN_S = 1 * MS, 10e-6  # an extend of n tokens: 1 ms + 10 us x n
DECODE_S = 6 * MS


def costs() -> StepCosts:
    learned = StepCosts()
    for n in (256, 512, 2048):
        learned.record_extend(n, FIXED_S + PER_TOKEN_S * n)
    learned.record_decode(DECODE_S)
    return learned


def budget(ms: float = 10.0) -> TpotBudget:
    return TpotBudget(ms, PAGE, MAX_CHUNK, costs())


def decode_step(b: TpotBudget, seconds: float = DECODE_S) -> None:
    b.decode_measured(seconds, b.decode_started())


def test_the_cost_line_is_fitted_from_extends_of_several_sizes():
    fixed, per_token = costs().extend_line()
    assert fixed == pytest.approx(FIXED_S) and per_token == pytest.approx(PER_TOKEN_S)
    assert costs().prefill_rate(1000) == pytest.approx(1000 / (FIXED_S + 1000 * PER_TOKEN_S))


def test_extends_of_one_size_give_a_line_through_the_origin_and_nothing_measured_gives_none():
    learned = StepCosts()
    assert learned.extend_line() == (0.0, 0.0) and learned.prefill_rate(512) == 0.0
    learned.record_extend(512, 5 * MS)
    learned.record_extend(512, 5 * MS)
    assert learned.extend_line() == (0.0, pytest.approx(5 * MS / 512))


def test_the_decode_time_follows_recent_steps():
    learned = StepCosts()
    learned.record_decode(6 * MS)
    assert learned.decode_s == 6 * MS
    for _ in range(100):
        learned.record_decode(9 * MS)
    assert learned.decode_s == pytest.approx(9 * MS, rel=1e-3)


def test_nothing_decoding_means_full_speed_and_a_fresh_credit():
    b = budget()
    decode_step(b)
    assert b.credit_s > 0 and b.extend_tokens(decoding=False) == MAX_CHUNK
    assert b.extend_started(MAX_CHUNK, decoding=False) is None and b.credit_s == 0.0


def test_an_extend_waits_for_credit_then_takes_the_largest_page_aligned_chunk_it_pays_for():
    b = budget(ms=20.0)
    assert b.extend_tokens(decoding=True, queued_tokens=1000) == 0  # no credit yet: a decode step first
    decode_step(b)  # earns 20 - 6 = 14 ms: (14 - 1) ms / 10 us = 1300 tokens, 1296 page-aligned
    assert b.credit_s == pytest.approx(14 * MS)
    assert b.extend_tokens(decoding=True, queued_tokens=1000) == 1296


def test_an_extend_borrows_an_efficient_chunk_which_decode_steps_then_repay():
    b = budget(ms=7.0)
    decode_step(b)  # 1 ms of credit: the extend still takes the 512 queued tokens (6.12 ms), or a saved chunk
    assert b.extend_tokens(decoding=True, queued_tokens=500) == 512
    tokens = b.extend_tokens(decoding=True, queued_tokens=10_000)
    assert tokens == SAVED_CHUNK_TOKENS
    charged = b.extend_started(tokens, decoding=True)
    assert charged == pytest.approx(FIXED_S + PER_TOKEN_S * tokens)
    b.extend_measured(tokens, charged, charged)
    assert b.credit_s == pytest.approx(1 * MS - charged) and b.extend_tokens(decoding=True, queued_tokens=1) == 0
    steps = 0
    while b.extend_tokens(decoding=True, queued_tokens=10_000) == 0:
        decode_step(b)
        steps += 1
    assert steps == 21  # 20.48 ms of debt, 1 ms repaid per step


def test_the_measured_time_settles_what_the_launch_charged():
    b = budget()
    decode_step(b)
    charged = b.extend_started(300, decoding=True)
    assert b.credit_s == pytest.approx(4 * MS - charged)
    b.extend_measured(300, charged + 2 * MS, charged)  # the forward took 2 ms longer than predicted
    assert b.credit_s == pytest.approx(4 * MS - charged - 2 * MS)


def test_the_credit_is_capped_and_an_outlier_leaves_a_bounded_debt():
    b = budget()
    for _ in range(100):
        decode_step(b)
    assert b.credit_s == pytest.approx(CREDIT_CAP_BUDGETS * 10 * MS)
    assert b.extend_tokens(decoding=True) == 3888  # (40 - 1) ms / 10 us, page-aligned
    charged = b.extend_started(256, decoding=True)
    b.extend_measured(256, 5.0, charged)  # a 5 s pause inside the extend
    assert b.credit_s == pytest.approx(-CREDIT_CAP_BUDGETS * 10 * MS)


def test_decode_steps_slower_than_the_budget_still_let_prefill_through():
    b = budget(ms=5.0)
    decode_step(b)
    assert b.credit_s == pytest.approx(MIN_EARN_SHARE * 5 * MS)
    assert b.extend_tokens(decoding=True, queued_tokens=256) == 256


def test_a_decode_step_earns_by_its_learned_time_at_launch_and_by_its_measured_time_once_read():
    b = budget()
    booked = b.decode_started()
    assert booked == pytest.approx(4 * MS) and b.credit_s == pytest.approx(4 * MS)
    b.decode_measured(8 * MS, booked)  # it took 8 ms: it earned 2
    assert b.credit_s == pytest.approx(2 * MS)


def test_an_unmeasured_decode_time_earns_the_least():
    b = TpotBudget(10.0, PAGE, MAX_CHUNK)
    assert b.decode_started() == pytest.approx(MIN_EARN_SHARE * 10 * MS)


def test_the_counters_report_the_mean_inter_token_time_achieved():
    b = budget()
    for _ in range(3):
        decode_step(b)
        charged = b.extend_started(256, decoding=True)
        b.extend_measured(256, 3 * MS, charged)
    stats = b.stats()
    assert (stats["decode_steps"], stats["extends"], stats["extend_tokens"]) == (3, 3, 768)
    assert stats["mean_itl_ms"] == pytest.approx(9.0)


def test_without_a_budget_every_extend_is_a_full_chunk_and_the_costs_are_learned_all_the_same():
    b = TpotBudget(0.0, PAGE, MAX_CHUNK)
    decode_step(b)
    assert not b.enabled and b.credit_s == 0.0 and b.extend_tokens(decoding=True) == MAX_CHUNK
    assert b.extend_started(512, decoding=True) is None
    b.extend_measured(512, 5 * MS, None)
    assert b.costs.decode_s == DECODE_S and b.costs.knows_extend and b.stats()["decode_steps"] == 0


def test_the_offered_rate_is_the_full_rate_times_the_budget_share_while_requests_decode():
    b = budget()
    full = MAX_CHUNK / (FIXED_S + PER_TOKEN_S * MAX_CHUNK)
    assert b.prefill_rate(decoding=False) == pytest.approx(full)
    assert b.prefill_share() == pytest.approx(0.4)  # 4 ms of prefill for every 6 ms decode step
    saved = SAVED_CHUNK_TOKENS
    assert b.prefill_rate(decoding=True) == pytest.approx(0.4 * saved / (FIXED_S + PER_TOKEN_S * saved))
    assert TpotBudget(0.0, PAGE, MAX_CHUNK, costs()).prefill_rate(decoding=True) == pytest.approx(full)
    assert TpotBudget(10.0, PAGE, MAX_CHUNK).prefill_rate(decoding=False) == 0.0  # nothing measured


def test_the_minimum_chunk_is_page_aligned_and_never_above_the_largest_chunk():
    assert TpotBudget(10.0, 48, MAX_CHUNK).min_chunk == 288
    assert TpotBudget(10.0, PAGE, 128).min_chunk == 128


def test_an_outlier_step_moves_the_learned_costs_by_a_bounded_amount():
    learned = costs()
    learned.record_extend(256, 5.0)
    learned.record_decode(5.0)
    assert learned.extend_s(256) < 4 * (FIXED_S + PER_TOKEN_S * 256) and learned.decode_s < 4 * DECODE_S


@pytest.mark.parametrize("bad", [dict(decode_tpot_budget_ms=-1.0), dict(decode_tpot_budget_ms=float("nan")),
                                 dict(decode_tpot_budget_ms=10.0, tp_size=2), dict(decode_tpot_burst_ms=-1.0),
                                 dict(decode_tpot_burst_ms=float("inf"))])
def test_a_budget_that_cannot_hold_is_refused_at_start(bad):
    with pytest.raises(ConfigError, match="--decode-tpot-bu"):
        ServerArgs(model_path="m", **bad)


def test_a_log_line_sums_up_each_window_in_which_the_budget_let_prompts_through(caplog, monkeypatch):
    monkeypatch.setattr("pdserve.scheduler.tpot_budget.LOG_EVERY_DECODE_STEPS", 4)
    b = budget()
    chunk_s = FIXED_S + PER_TOKEN_S * 256  # as predicted: the learned line stays
    with caplog.at_level("INFO", logger="pdserve.scheduler.tpot_budget"):
        for _ in range(4):
            decode_step(b)  # a window without prefill: no line
        for _ in range(4):
            b.extend_measured(256, chunk_s, b.extend_started(256, decoding=True))
            decode_step(b)
    assert [r.getMessage() for r in caplog.records] == [
        "TPOT budget 10 ms: 4 decode steps, 4 prefill chunks (1024 tokens) beside them, mean inter-token time "
        "9.56 ms; learned: decode step 6.00 ms, chunk 1.00 ms + 10.00 us per token"]


# ---- saved credit (--decode-tpot-burst-ms) ----------------------------------------------------------------------

STEADY_S = CREDIT_CAP_BUDGETS * 10 * MS  # the steady cap of a 10 ms budget here (above a saved chunk's 21.48 ms)


def bursting(burst_ms: float, running: dict, max_chunk: int = MAX_CHUNK) -> TpotBudget:
    return TpotBudget(10.0, PAGE, max_chunk, costs(), burst_ms=burst_ms, running_ids=running.keys)


def test_saved_credit_lets_one_extend_take_a_long_prompt_at_full_speed():
    running = {"a": None}
    b = bursting(60.0, running)
    for _ in range(100):
        decode_step(b)  # 4 ms a step, saved up to the burst
    assert b.credit_s == pytest.approx(60 * MS)
    assert b.extend_tokens(decoding=True, queued_tokens=7000) == 5888  # (60 - 1) ms / 10 us, page-aligned
    assert b.load_report()["local_prefill_burst_s"] == pytest.approx(0.06)


def test_without_a_burst_the_credit_stops_at_the_steady_cap_as_before():
    running = {"a": None}
    b = bursting(0.0, running)
    for _ in range(100):
        decode_step(b)
    assert b.credit_s == pytest.approx(STEADY_S) and b.extend_tokens(decoding=True, queued_tokens=7000) == 3888
    assert b.load_report() == {"local_prefill_burst_s": 0.0, "extend_fixed_ms": 1.0, "extend_us_per_token": 10.0}


def test_a_request_that_joins_meets_the_steady_cap_until_it_has_banked_more():
    running = {"a": None}
    b = bursting(250.0, running)
    for _ in range(100):
        decode_step(b)
    running["b"] = None  # joins a server that saved 250 ms: it may meet 40 ms, as without bursts
    assert b.extend_tokens(decoding=True, queued_tokens=30_000) == 3888
    for _ in range(5):
        decode_step(b)  # banks 4 ms a step
    assert b.extend_tokens(decoding=True, queued_tokens=30_000) == 5888  # (40 + 20 - 1) ms
    del running["b"]  # left: "a" banked the whole burst
    assert b.extend_tokens(decoding=True, queued_tokens=30_000) == MAX_CHUNK


def test_after_a_burst_the_requests_that_paid_it_repay_before_the_next():
    running = {"a": None}
    b = bursting(250.0, running, max_chunk=32768)
    for _ in range(100):
        decode_step(b)
    tokens = b.extend_tokens(decoding=True, queued_tokens=30_000)
    assert tokens == 24896  # (250 - 1) ms
    b.extend_measured(tokens, FIXED_S + PER_TOKEN_S * tokens, b.extend_started(tokens, decoding=True))
    assert b.load_report()["local_prefill_burst_s"] == pytest.approx(0.04 * MS)  # the page rounding's rest
    assert b.extend_tokens(decoding=True, queued_tokens=30_000) == SAVED_CHUNK_TOKENS  # borrowed, as before
    b.extend_measured(2048, 21.48 * MS, b.extend_started(2048, decoding=True))
    steps = 0
    while b.extend_tokens(decoding=True, queued_tokens=30_000) == 0:
        decode_step(b)
        steps += 1
    assert steps == 6  # 21.44 ms of debt, 4 ms repaid per step


def test_an_outlier_during_a_burst_leaves_at_most_the_debt_limit():
    running = {"a": None}
    b = bursting(250.0, running)
    for _ in range(100):
        decode_step(b)
    running["b"] = None
    tokens = b.extend_tokens(decoding=True, queued_tokens=30_000)
    b.extend_measured(tokens, 5.0, b.extend_started(tokens, decoding=True))  # a 5 s pause inside the extend
    assert b.credit_s == pytest.approx(-STEADY_S) and b._spendable_s() == pytest.approx(-STEADY_S)


def test_nothing_decoding_forgets_the_joins_and_reports_no_burst():
    running = {"a": None}
    b = bursting(250.0, running)
    for _ in range(10):
        decode_step(b)
    running.clear()
    assert b.load_report()["local_prefill_burst_s"] == 0.0  # a prompt goes at full speed anyway
    assert b.extend_started(512, decoding=False) is None and (b.credit_s, b.joined_at) == (0.0, {})


def simulate_mix(burst_ms: float, join_every: int, steps: int = 20_000):
    """Requests join every `join_every` steps and decode 50 to 300 tokens; an 800-token prompt comes every 20 steps
    and a 20,000-token one every 300. Each step runs what the budget allows, at the learned costs exactly. Returns
    the budget, each finished request's (tokens, seconds from join to its last token) and the longest extend."""
    running: dict[str, list] = {}
    b = bursting(burst_ms, running, max_chunk=32768)
    finished, queued, joined, longest = [], 0, 0, 0.0
    for step in range(steps):
        if step % join_every == 0:
            joined += 1
            running[f"r{joined}"] = [0, 0.0, 50 + joined * 53 % 250]  # tokens, seconds, tokens to decode
        queued += (20_000 if step % 300 == 0 else 0) + (800 if step % 20 == 0 else 0)
        tokens = min(queued, b.extend_tokens(decoding=bool(running), queued_tokens=queued))
        if tokens:
            seconds = FIXED_S + PER_TOKEN_S * tokens
            b.extend_measured(tokens, seconds, b.extend_started(tokens, decoding=bool(running)))
            queued -= tokens
            longest = max(longest, seconds) if running else longest
            for req in running.values():
                req[1] += seconds
            continue
        decode_step(b)
        for rid, req in list(running.items()):
            req[0] += 1
            req[1] += DECODE_S
            if req[0] == req[2]:
                finished.append((req[0], req[1]))
                del running[rid]
    return b, finished, longest


@pytest.mark.parametrize("join_every", [15, 80])
@pytest.mark.parametrize("burst_ms", [0.0, 250.0])
def test_a_simulated_mix_keeps_each_request_within_the_controllers_bound(burst_ms, join_every):
    b, finished, longest = simulate_mix(burst_ms, join_every)
    assert len(finished) > 100
    assert b.stats()["mean_itl_ms"] <= 10.0  # the long-run mean inter-token time
    for tokens, seconds in finished:  # budget x tokens + what it may meet on joining + what it may owe on leaving
        assert seconds <= tokens * 10 * MS + 2 * STEADY_S + 1e-9
    if burst_ms and join_every == 80:
        assert longest > 5 * STEADY_S  # bursts ran, one long prompt in one gap
    if not burst_ms:
        assert longest < STEADY_S  # never more than the steady cap with requests decoding
