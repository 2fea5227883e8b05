"""The TPOT budget through the real scheduler on the tiny CPU model, with the forwards' times set by the test (a
clock each forward advances: a decode step 6 ms, an extend 1 ms + 20 us per token): prompts prefilled beside
running requests interleave with decode steps so that the running requests' mean inter-token time stays within the
budget while the budget is used; the greedy output equals the run without a budget; retraction, prefix hits, an
abort mid-prefill, a grammar and the decode role's local prefills all stay correct; the KV pool ends fully free."""

from __future__ import annotations

import json
import time

import pytest

from pdserve.config import ServerArgs
from pdserve.disagg.factory import create_scheduler
from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.request import Req
from pdserve.scheduler.scheduler import Scheduler
from pdserve.scheduler.step_timer import StepTimer
from pdserve.scheduler.tpot_budget import MIN_CHUNK_TOKENS

BUDGET_MS = 10.0
DECODE_MS = 6.0
EXTEND_FIXED_MS, EXTEND_MS_PER_TOKEN = 1.0, 0.02
DRAIN_TIMEOUT_S = 120.0


class ForwardClock:
    """Seconds that only the forwards advance, by their set cost; logs each forward as (kind, size, start, end)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.forwards: list[tuple[str, int, float, float]] = []

    def __call__(self) -> float:
        return self.now

    def observe(self, batch: ForwardBatch) -> None:
        if batch.mode == ForwardMode.EXTEND:
            kind, size = "extend", sum(batch.extend_lens_cpu)
            ms = EXTEND_FIXED_MS + EXTEND_MS_PER_TOKEN * size
        else:
            kind, size, ms = "decode", batch.batch_size, DECODE_MS
        self.forwards.append((kind, size, self.now, self.now + ms / 1e3))
        self.now += ms / 1e3


def timed(sched: Scheduler) -> ForwardClock:
    clock = ForwardClock()
    sched.step_timer = StepTimer(sched.device, clock)
    sched.runner.forward_observers.append(clock.observe)
    return clock


def engine_args(model: str, **kw) -> dict:
    return dict(model_path=model, device="cpu", max_total_tokens=8192, page_size=4, chunked_prefill_size=1024,
                disable_radix_cache=True) | kw


def make(model: str, budget_ms: float = BUDGET_MS, **kw) -> tuple[Scheduler, ForwardClock]:
    sched = create_scheduler(ServerArgs(decode_tpot_budget_ms=budget_ms, **engine_args(model, **kw)))
    return sched, timed(sched)


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 131 + i * 37) % 1200 + 5 for i in range(length)]


def greedy(rid: str, ids: list[int], n: int, **params) -> Req:
    return Req.of(rid, ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **params))


def drain(sched: Scheduler, outputs: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """Steps until nothing is left; a grammar compiling in its thread makes steps that do nothing, so the bound is
    time, not a step count."""
    outputs = {} if outputs is None else outputs
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while time.monotonic() < deadline:
        if not sched.has_work():
            return outputs
        for out in sched.step():
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
    raise AssertionError("the scheduler did not drain")


def start_decoding(sched: Scheduler, reqs: list[Req]) -> dict[str, list[int]]:
    """Adds reqs and steps until all of them decode."""
    outputs: dict[str, list[int]] = {}
    for r in reqs:
        sched.add_request(r)
    while not all(r in sched.running for r in reqs):
        for out in sched.step():
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
    return outputs


def the_mix() -> tuple[list[Req], list[Req]]:
    """Two requests decoding long, then three long prompts (chunked beside them) with short outputs."""
    decoding = [greedy("decode-0", prompt(0, 30), 60), greedy("decode-1", prompt(1, 45), 60)]
    prompts = [greedy(f"prompt-{i}", prompt(10 + i, 600 + 100 * i), 4) for i in range(3)]
    return decoding, prompts


def run_the_mix(model: str, budget_ms: float, **kw) -> tuple[dict[str, list[int]], Scheduler, ForwardClock]:
    sched, clock = make(model, budget_ms, **kw)
    decoding, prompts = the_mix()
    outputs = start_decoding(sched, decoding)
    for r in prompts:
        sched.add_request(r)
    return drain(sched, outputs), sched, clock


def while_prefilling(clock: ForwardClock) -> list[tuple[str, int, float, float]]:
    """The forwards from the first decode step to the last extend: the stretch where prompts waited beside
    running requests."""
    first = next(i for i, f in enumerate(clock.forwards) if f[0] == "decode")
    last = max(i for i, f in enumerate(clock.forwards) if f[0] == "extend")
    return clock.forwards[first : last + 1]


@pytest.fixture(scope="module")
def unbudgeted(tiny_model) -> dict[str, list[int]]:
    outputs, sched, _ = run_the_mix(tiny_model, 0.0)
    sched.close()
    return outputs


@pytest.mark.parametrize("overlap", [False, True])
def test_prefill_beside_decodes_keeps_the_mean_inter_token_time_within_the_budget(tiny_model, unbudgeted, overlap):
    outputs, sched, clock = run_the_mix(tiny_model, BUDGET_MS, disable_overlap_schedule=not overlap)
    assert outputs == unbudgeted  # every request, every token, as without a budget
    stretch = while_prefilling(clock)
    decode_steps = sum(kind == "decode" for kind, *_ in stretch)
    elapsed_ms = (stretch[-1][3] - stretch[0][2]) * 1e3
    one_min_chunk_ms = EXTEND_FIXED_MS + EXTEND_MS_PER_TOKEN * MIN_CHUNK_TOKENS
    assert decode_steps > 10
    # within the budget, less at most one chunk's debt; and the budget is used (no idle decode steps)
    assert elapsed_ms <= decode_steps * BUDGET_MS + one_min_chunk_ms
    assert elapsed_ms >= decode_steps * BUDGET_MS - (BUDGET_MS - DECODE_MS)
    extends = [size for kind, size, *_ in stretch if kind == "extend"]
    # saved up for: a saved chunk or all the queued tokens, never bits of a few pages
    assert min(extends[:-1]) >= MIN_CHUNK_TOKENS
    assert sched.stats()["tpot_budget"]["extends"] == len(extends)
    assert sched.kv_pool_is_fully_free()
    sched.close()


def test_without_running_requests_prompts_prefill_in_full_chunks(tiny_model):
    sched, clock = make(tiny_model)
    sched.add_request(greedy("alone", prompt(3, 2500), 2))
    drain(sched)
    assert [size for kind, size, *_ in clock.forwards if kind == "extend"] == [1024, 1024, 452]
    sched.close()


def test_a_retraction_beside_a_budgeted_prefill_recomputes_and_matches(tiny_model):
    results = []
    for budget_ms in (0.0, BUDGET_MS):  # 3 x (40 + 100) tokens outgrow the 384-token pool
        sched, _ = make(tiny_model, budget_ms, max_total_tokens=384, schedule_conservativeness=0.0)
        outputs = start_decoding(sched, [greedy(f"grow-{i}", prompt(20 + i, 40), 100) for i in range(3)])
        sched.add_request(greedy("prompt", prompt(8, 200), 4))
        results.append(drain(sched, outputs))
        assert sched.num_retracted > 0 and sched.kv_pool_is_fully_free()
        sched.close()
    assert results[0] == results[1]


def test_prefix_hits_and_an_abort_mid_prefill_beside_decodes_stay_correct(tiny_model):
    results = []
    for budget_ms in (0.0, BUDGET_MS):
        sched, _ = make(tiny_model, budget_ms, disable_radix_cache=False)
        shared = prompt(7, 500)
        outputs = start_decoding(sched, [greedy("decode", prompt(0, 30), 80)])
        sched.add_request(greedy("first", shared + prompt(8, 40), 4))
        sched.add_request(greedy("aborted", prompt(9, 700), 4))
        while sched.reqs["aborted"].num_cached_tokens == 0:
            for out in sched.step():
                outputs.setdefault(out.rid, []).extend(out.new_token_ids)
        if budget_ms:
            assert sched.reqs["aborted"] is sched.chunked  # aborted mid-prefill
        sched.abort_request("aborted")
        sched.add_request(greedy("second", shared + prompt(11, 60), 4))  # the first's prompt is cached by now
        drain(sched, outputs)
        assert sched.radix.hit_tokens >= 500 - 4 and sched.kv_pool_is_fully_free()
        results.append(outputs)
        sched.close()
    assert results[0] == results[1]


def test_a_request_under_a_grammar_prefilled_within_the_budget_matches(tiny_model):
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    results = []
    for budget_ms in (0.0, BUDGET_MS):
        sched, _ = make(tiny_model, budget_ms)
        outputs = start_decoding(sched, [greedy("decode", prompt(0, 30), 60)])
        sched.add_request(greedy("json", prompt(5, 800), 30, json_schema=schema))
        results.append(drain(sched, outputs))
        assert sched.kv_pool_is_fully_free()
        sched.close()
    assert results[0] == results[1]


def test_the_decode_role_prefills_local_prompts_within_the_budget(tiny_model, unbudgeted):
    decode, clock = make(tiny_model, disaggregation_mode="decode", disaggregation_transfer_backend="tcp", port=2)
    decoding, prompts = the_mix()
    outputs = start_decoding(decode, decoding)  # requests without bootstrap fields: the router's local path
    for r in prompts:
        decode.add_request(r)
    assert drain(decode, outputs) == unbudgeted
    stretch = while_prefilling(clock)
    decode_steps = sum(kind == "decode" for kind, *_ in stretch)
    assert (stretch[-1][3] - stretch[0][2]) * 1e3 <= decode_steps * BUDGET_MS + EXTEND_FIXED_MS + \
        EXTEND_MS_PER_TOKEN * MIN_CHUNK_TOKENS
    assert decode.role.num_local_prefills == 5 and decode.kv_pool_is_fully_free()
    decode.close()


def test_a_decode_server_without_a_budget_offers_no_local_prefill(tiny_model):
    decode, _ = make(tiny_model, 0.0, disaggregation_mode="decode", disaggregation_transfer_backend="tcp", port=2)
    decode.add_request(greedy("local", prompt(4, 300), 3))
    drain(decode)
    report = decode.load_report()
    assert report["prefill_tokens_per_s"] > 0 and report["local_prefill_tokens_per_s"] == 0.0
    assert report["tpot_budget_ms"] == 0.0
    decode.close()


def test_the_load_report_offers_the_budget_share_while_requests_decode(tiny_model):
    sched, _ = make(tiny_model)
    idle = sched.load_report()
    assert idle["local_prefill_tokens_per_s"] == 0.0 and idle["tpot_budget_ms"] == BUDGET_MS  # nothing measured
    for length in (300, 700):  # extends of two sizes: the fixed cost and the cost per token
        sched.add_request(greedy(f"warm-{length}", prompt(length, length), 2))
        drain(sched)
    full = sched.load_report()["local_prefill_tokens_per_s"]
    assert full == pytest.approx(1024 / (EXTEND_FIXED_MS + EXTEND_MS_PER_TOKEN * 1024) * 1e3, rel=1e-3)
    start_decoding(sched, [greedy("decode", prompt(0, 30), 50)])
    for _ in range(3):
        sched.step()
    report = sched.load_report()
    share = (BUDGET_MS - DECODE_MS) / BUDGET_MS
    saved = sched.tpot_budget.saved_chunk
    rate = saved / (EXTEND_FIXED_MS + EXTEND_MS_PER_TOKEN * saved) * 1e3
    assert report["local_prefill_tokens_per_s"] == pytest.approx(share * rate, rel=1e-3)
    assert report["decode_step_ms"] == pytest.approx(DECODE_MS) and report["num_running_reqs"] == 1
    assert 0 < report["kv_usage"] < 1
    drain(sched)
    sched.close()
