"""Batching, sampling and memory behaviour of the engine on one tiny model."""

from __future__ import annotations

import random

import pytest

from pdserve import LLM, SamplingParams
from pdserve.config import ConfigError
from pdserve.sampling_params import SamplingParamsError
from pdserve.bench.roofline import WorkCounters
from pdserve.scheduler.extend_batch import token_slots
from pdserve.scheduler.request import Req


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, device="cpu", dtype="float32", page_size=4, max_total_tokens=4096, chunked_prefill_size=64)


def prompts(n, seed=0, lo=3, hi=60):
    rng = random.Random(seed)
    return [[rng.randrange(3, 900) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def greedy(n=12):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_greedy_output_does_not_depend_on_batch(llm):
    ps = prompts(8)
    alone = [llm.generate([p], greedy(), use_tqdm=False)[0].token_ids for p in ps]
    together = [o.token_ids for o in llm.generate(ps, greedy(), use_tqdm=False)]
    assert alone == together
    assert llm.scheduler.kv_pool_is_fully_free()


def test_seeded_sampling_is_reproducible_and_seed_sensitive(llm):
    p = prompts(1, seed=5)[0]
    sp = dict(temperature=1.0, top_p=0.95, max_tokens=16, ignore_eos=True)
    a = llm.generate([p], SamplingParams(seed=7, **sp), use_tqdm=False)[0].token_ids
    b = llm.generate([p, *prompts(3, seed=6)], SamplingParams(seed=7, **sp), use_tqdm=False)[0].token_ids
    c = llm.generate([p], SamplingParams(seed=8, **sp), use_tqdm=False)[0].token_ids
    assert a == b
    assert a != c


def test_top_k_1_equals_greedy(llm):
    ps = prompts(3, seed=9)
    g = [o.token_ids for o in llm.generate(ps, greedy(), use_tqdm=False)]
    k1 = [o.token_ids for o in llm.generate(ps, SamplingParams(temperature=0.8, top_k=1, max_tokens=12, ignore_eos=True), use_tqdm=False)]
    assert g == k1


def test_stop_token_ids_and_max_tokens(llm):
    p = prompts(1, seed=11)[0]
    free_run = llm.generate([p], greedy(10), use_tqdm=False)[0]
    stop_at = free_run.token_ids[4]
    first = free_run.token_ids.index(stop_at)
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert out.token_ids == free_run.token_ids[: first + 1]
    assert out.finish_reason == {"type": "stop", "matched": stop_at}
    assert len(free_run.token_ids) == 10 and free_run.finish_reason["type"] == "length"


def test_stop_string_cuts_text(llm):
    p = "The quick brown fox"
    free_run = llm.generate([p], greedy(20), use_tqdm=False)[0]
    text = free_run.text
    stop = next(text[i : i + 2] for i in range(len(text) // 3, len(text) - 1) if not text[i : i + 2].isspace()
                and " " not in text[i : i + 2])
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]), use_tqdm=False)[0]
    assert out.finish_reason["type"] == "stop" and out.finish_reason["matched"] == stop
    assert stop not in out.text and text.startswith(out.text)


def test_penalties_change_output_and_stay_valid(llm):
    p = prompts(1, seed=12)[0]
    base = llm.generate([p], greedy(16), use_tqdm=False)[0].token_ids
    pen = llm.generate([p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=2.0,
                                           frequency_penalty=2.0, presence_penalty=2.0), use_tqdm=False)[0].token_ids
    assert len(pen) == 16 and pen != base
    assert len(set(pen)) >= len(set(base))


def test_logprobs_are_consistent(llm):
    p = prompts(1, seed=13)[0]
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2),
                       use_tqdm=False)[0]
    assert len(out.logprobs) == 6 and all(lp <= 0 for lp in out.logprobs)
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert len(top) == 3 and top[0][0] == tok and abs(top[0][1] - lp) < 1e-5  # greedy = top-1
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
    assert all(v <= 0 for v in out.prompt_logprobs[1:])


def test_retraction_under_memory_pressure_keeps_outputs(tiny_model):
    ps = prompts(6, seed=20, lo=20, hi=30)
    roomy = LLM(tiny_model, device="cpu", dtype="float32", page_size=4, max_total_tokens=4096)
    tight = LLM(tiny_model, device="cpu", dtype="float32", page_size=4, max_total_tokens=160,
                schedule_conservativeness=0.1, disable_radix_cache=True)
    expected = [o.token_ids for o in roomy.generate(ps, greedy(40), use_tqdm=False)]
    got = [o.token_ids for o in tight.generate(ps, greedy(40), use_tqdm=False)]
    assert got == expected
    assert tight.scheduler.num_retracted > 0
    assert tight.scheduler.kv_pool_is_fully_free()


def test_abort_frees_pages_at_any_point(llm):
    sched = llm.scheduler
    for steps_before_abort in (0, 1, 3):
        req = Req(rid=f"abort-{steps_before_abort}", input_ids=prompts(1, seed=30)[0] * 3, sampling_params=greedy(50))
        sched.add_request(req)
        for _ in range(steps_before_abort):
            sched.step()
        sched.abort_request(req.rid)
        outs = sched.step()
        assert any(o.rid == req.rid and o.finish_reason["type"] == "abort" for o in outs)
    assert not sched.has_work()
    assert sched.kv_pool_is_fully_free()


def test_flush_cache_empties_radix(llm):
    llm.generate(prompts(2, seed=40), greedy(4), use_tqdm=False)
    assert llm.scheduler.flush_cache()
    assert llm.scheduler.allocator.num_free == llm.scheduler.allocator.capacity


@pytest.mark.parametrize("bad", [
    dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=0), dict(max_tokens=-1),
    dict(min_p=2), dict(repetition_penalty=0), dict(frequency_penalty=3), dict(logprobs=100), dict(stop=[""]),
])
def test_invalid_sampling_params_raise(bad):
    with pytest.raises(SamplingParamsError):
        SamplingParams(**bad)


def test_invalid_requests_raise_clear_errors(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="context length"):
        llm.generate([[5] * 5000], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[10**7]], greedy(), use_tqdm=False)
    with pytest.raises(ConfigError, match="unknown engine argument"):
        LLM("x", no_such_flag=1)
    with pytest.raises(ConfigError, match="page-size"):
        LLM("x", page_size=0)
    assert llm.scheduler.kv_pool_is_fully_free()


def test_unsupported_architecture_is_refused(tmp_path, tiny_model):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(str(bad), device="cpu")


def test_overlap_schedule_matches_synchronous_decode(tiny_model, llm):
    ps = prompts(6, seed=50)
    sync = LLM(tiny_model, device="cpu", dtype="float32", page_size=4, max_total_tokens=4096,
               chunked_prefill_size=64, disable_overlap_schedule=True)
    sp = [greedy(12), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=1.0)] * 3
    assert llm.scheduler.overlap and not sync.scheduler.overlap
    assert [o.token_ids for o in llm.generate(ps, sp, use_tqdm=False)] == \
           [o.token_ids for o in sync.generate(ps, sp, use_tqdm=False)]
    assert llm.scheduler.kv_pool_is_fully_free() and sync.scheduler.kv_pool_is_fully_free()


def test_token_slots_match_per_position_lookup():
    rng = random.Random(0)
    for _ in range(2000):
        page_size = rng.choice([1, 2, 4, 16, 64])
        pages = rng.sample(range(1, 5000), 300)
        start = rng.randrange(0, 300 * page_size)
        end = rng.randrange(start, min(300 * page_size, start + 700) + 1)
        expected = [pages[p // page_size] * page_size + p % page_size for p in range(start, end)]
        assert token_slots(pages, start, end, page_size) == expected


def test_a_forward_observer_counts_the_work_of_every_pass(llm):
    work = WorkCounters()
    llm.scheduler.runner.forward_observers.append(work.observe)
    try:
        llm.generate([list(range(3, 13)), list(range(20, 26))], greedy(5), use_tqdm=False)
    finally:
        llm.scheduler.runner.forward_observers.remove(work.observe)
    assert (work.extend_tokens, work.extend_attention_pairs) == (16, 10 * 11 // 2 + 6 * 7 // 2)
    steps = work.decode_steps  # 4, or 5 where the overlap scheduler launched one pass past the end
    assert steps in (4, 5) and work.decode_tokens == 2 * steps
    assert work.decode_kv_tokens_read == sum((11 + i) + (7 + i) for i in range(steps))


def test_context_length_past_the_model_positions_is_refused(tiny_model):
    with pytest.raises(ConfigError, match=r"max_position_embeddings \(4096\)"):
        LLM(tiny_model, device="cpu", context_length=5000)
