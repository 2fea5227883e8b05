"""The TPOT budget's credit controller and step-cost model, with step times given by the test: chunk sizing,
credit accounting (earn, spend, settle, cap, debt), full speed with nothing decoding, and the rates `/load` offers."""

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
                                 dict(decode_tpot_budget_ms=10.0, tp_size=2)])
def test_a_budget_that_cannot_hold_is_refused_at_start(bad):
    with pytest.raises(ConfigError, match="--decode-tpot-budget-ms"):
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
