"""Constrained batches decode overlapped: the step launches its forward, reads the previous step back while it runs
(the matchers take its tokens), then fills the token bitmask and samples on the device, and draws what synchronous
decoding draws; a request that ends in that read-back (its grammar ended, its length) is not masked again and its
pages wait for the launched batch."""

from __future__ import annotations

import re

import pytest

from pdserve import LLM, SamplingParams
from pdserve.scheduler.request import Req

pytest.importorskip("xgrammar")
LETTERS = "[a-z]{100}"  # no 12 tokens hold 100 letters: every request runs to max_tokens, in one batch shape
PROMPTS = [[5, 6, 7], [11, 12, 13, 14], [20, 21], [30, 31, 32, 33, 34]]


def new_llm(path: str, **kw) -> LLM:
    return LLM(path, device="cpu", dtype="float32", page_size=4, max_total_tokens=4096, chunked_prefill_size=256,
               skip_server_warmup=True, **kw)


@pytest.fixture(scope="module")
def engines(tiny_model):
    overlap, sync = new_llm(tiny_model), new_llm(tiny_model, disable_overlap_schedule=True)
    for engine in (overlap, sync):  # compiled before the tests: their requests start in the step they are added
        engine.generate([[1]], SamplingParams(max_tokens=1, regex=LETTERS), use_tqdm=False)
    yield overlap, sync
    overlap.shutdown()
    sync.shutdown()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_constrained_batch_overlaps_and_draws_what_synchronous_decode_draws(engines, temperature):
    params = [SamplingParams(temperature=temperature, max_tokens=12, regex=LETTERS),
              SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True)]  # a free row in the batch
    for engine in engines:
        engine.scheduler.sampler.reseed(engine.args.random_seed)
    outs = [engine.generate(PROMPTS, [params[i % 2] for i in range(len(PROMPTS))], use_tqdm=False)
            for engine in engines]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert all(re.fullmatch("[a-z]+", o.text) and len(o.token_ids) == 12 for o in outs[0][::2])
    sched = engines[0].scheduler  # all four requests prefill in one step
    for i, prompt in enumerate(PROMPTS):
        sched.add_request(Req.of(f"r{i}", prompt, SamplingParams.from_dict(params[i % 2].to_dict())))
    sched.step()
    assert len(sched.running) == len(PROMPTS) and sched.inflight is None
    sched.step()
    assert sched.inflight is not None and len(sched.inflight.reqs) == len(PROMPTS)  # launched, not read back
    masked_rows = sched.num_masked_rows
    while sched.has_work():
        sched.step()
    assert sched.num_masked_rows > masked_rows and sched.kv_pool_is_fully_free()


def test_requests_ending_in_the_read_back_are_not_masked_again_and_free_their_pages(engines):
    overlap, _ = engines
    params = [SamplingParams(temperature=1.0, max_tokens=40, regex="yes|no", ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=3, regex=LETTERS),
              SamplingParams(temperature=1.0, max_tokens=9, regex=LETTERS),
              SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)]
    outs = overlap.generate(PROMPTS * 3, params * 3, use_tqdm=False)
    for i, out in enumerate(outs):
        if i % 4 == 0:
            assert out.text in ("yes", "no") and out.finish_reason["type"] == "stop"
        elif i % 4 in (1, 2):
            assert re.fullmatch("[a-z]+", out.text) and len(out.token_ids) == params[i % 4].max_tokens
        else:
            assert len(out.token_ids) == 20
    assert overlap.scheduler.kv_pool_is_fully_free() and overlap.scheduler.inflight is None
