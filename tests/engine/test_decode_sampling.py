"""Decode sampling on the device: `ModelRunner.decode_tokens` draws greedy and temperature-only batches (inside the
decode CUDA graph on a GPU, eagerly on a CPU) and every other batch falls back to the logits and the Sampler."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.kernels.sampling import gumbel_max_sample, gumbel_max_sample_ref
from pdserve.scheduler.decode_input_batch import DecodeInputBatch
from pdserve.scheduler.request import Req

TEMPERATURE_ONLY = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)


def new_llm(path: str, **kw) -> LLM:
    return LLM(path, device="cpu", dtype="float32", page_size=4, max_total_tokens=4096, chunked_prefill_size=256, **kw)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return new_llm(tiny_model)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 900) for _ in range(rng.randrange(4, 30))] for _ in range(n)]


def decode_state(temperatures: list[float], page_size: int, device, **params) -> DecodeInputBatch:
    """A decode batch of one request per temperature, each on a page of its own."""
    reqs = []
    for i, t in enumerate(temperatures):
        req = Req(rid=f"r{i}", input_ids=[3, 4, 5], sampling_params=SamplingParams(temperature=t, **params))
        req.pages = [5 + i]
        reqs.append(req)
    return DecodeInputBatch(reqs, page_size=page_size, max_pages=16, device=torch.device(device))


def record_decode_tokens(runner) -> list[bool]:
    """Spies on runner.decode_tokens: one entry per call, True where it sampled (not None)."""
    sampled: list[bool] = []
    inner = runner.decode_tokens

    def recording(batch, sampling):
        tokens = inner(batch, sampling)
        sampled.append(tokens is not None)
        return tokens

    runner.decode_tokens = recording
    return sampled


def test_decode_tokens_draw_the_reference_sample_of_the_forward_logits(llm):
    runner = llm.scheduler.runner
    state = decode_state([0.0, 0.7, 1.3, 0.0], page_size=4, device="cpu")
    batch = state.forward_batch([11, 12, 13, 14], [2, 2, 3, 1])
    logits = runner.forward(batch)
    rng = runner.sampler.gumbel_rng.clone()
    tokens = runner.decode_tokens(batch, state.sampling)
    assert torch.equal(tokens, gumbel_max_sample_ref(logits, state.sampling.temperatures, rng))
    assert torch.equal(tokens[[0, 3]], logits[[0, 3]].argmax(dim=-1))
    assert runner.sampler.gumbel_rng.tolist() == rng.tolist()  # both one step further


@pytest.mark.parametrize("params", [dict(top_p=0.9), dict(top_k=5), dict(min_p=0.1), dict(presence_penalty=0.5),
                                    dict(seed=4)])
def test_decode_tokens_leave_filters_penalties_and_seeds_to_the_logits_path(llm, params):
    runner = llm.scheduler.runner
    state = decode_state([0.7, 0.7], page_size=4, device="cpu", **params)
    batch = state.forward_batch([11, 12], [2, 2])
    seen, rng = [], runner.sampler.gumbel_rng.clone()
    runner.forward_observers.append(seen.append)
    try:
        assert runner.decode_tokens(batch, state.sampling) is None
    finally:
        runner.forward_observers.remove(seen.append)
    assert seen == [] and torch.equal(runner.sampler.gumbel_rng, rng)  # nothing ran, nothing drawn


@pytest.mark.parametrize("overlap", [True, False])
def test_temperature_only_batches_sample_in_decode_tokens_and_a_top_p_row_falls_back(tiny_model, overlap):
    llm = new_llm(tiny_model, disable_overlap_schedule=not overlap)
    sampled = record_decode_tokens(llm.scheduler.runner)
    outs = llm.generate(prompts(4, seed=1), TEMPERATURE_ONLY, use_tqdm=False)
    assert all(len(o.token_ids) == 10 for o in outs)
    assert sampled and all(sampled)
    sampled.clear()
    mixed = [TEMPERATURE_ONLY, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, ignore_eos=True)]
    outs = llm.generate(prompts(2, seed=2), mixed, use_tqdm=False)
    assert all(len(o.token_ids) == 10 for o in outs)
    assert sampled and not any(sampled)
    assert llm.scheduler.kv_pool_is_fully_free()


def test_temperature_sampling_is_reproducible_for_a_random_seed(tiny_model):
    ps = prompts(5, seed=3)
    first = [o.token_ids for o in new_llm(tiny_model).generate(ps, TEMPERATURE_ONLY, use_tqdm=False)]
    cold = new_llm(tiny_model, skip_server_warmup=True)  # the warm-up leaves the random state as it found it
    assert [o.token_ids for o in cold.generate(ps, TEMPERATURE_ONLY, use_tqdm=False)] == first
    other_seed = new_llm(tiny_model, random_seed=1)
    assert [o.token_ids for o in other_seed.generate(ps, TEMPERATURE_ONLY, use_tqdm=False)] != first


def test_bf16_logits_stay_bf16_until_penalties_or_logprobs(tiny_model):
    llm = LLM(tiny_model, device="cpu", dtype="bfloat16", page_size=4, max_total_tokens=4096)
    state = decode_state([0.0, 0.7], page_size=4, device="cpu")
    assert llm.scheduler.runner.forward(state.forward_batch([11, 12], [2, 2])).dtype == torch.bfloat16
    sp = SamplingParams(temperature=0.7, max_tokens=6, ignore_eos=True, frequency_penalty=0.5, logprobs=2,
                        prompt_logprobs=1)
    out = llm.generate(prompts(2, seed=4), sp, use_tqdm=False)
    assert all(len(o.token_ids) == len(o.logprobs) == 6 for o in out)
    logprobs = [lp for o in out for lp in (*o.logprobs, *o.prompt_logprobs[1:])]
    assert all(-1e4 < lp <= 0 for lp in logprobs)  # finite log-probabilities, no NaN
    assert llm.scheduler.kv_pool_is_fully_free()


@pytest.mark.gpu
def test_graph_tokens_equal_eager_tokens(tiny_models):
    path = tiny_models["qwen3-0.6b"]
    # graphs of 1, 2, 4 and 8 rows and no warm-up: what the test replays (a GPU engine's start is seconds a graph size)
    lean = dict(device="cuda", page_size=16, max_total_tokens=65536, skip_server_warmup=True)
    graphed = LLM(path, cuda_graph_max_bs=8, **lean).scheduler.runner
    eager = LLM(path, disable_cuda_graph=True, **lean).scheduler.runner
    assert graphed.graph_runner is not None and eager.graph_runner is None
    for temperatures in ([0.0] * 5, [0.6, 1.0, 0.0, 0.6, 1.4]):  # 5 rows: replayed as the padded 8-row graph
        state = decode_state(temperatures, page_size=16, device="cuda")
        batch = state.forward_batch([101, 202, 303, 404, 505], [3, 2, 1, 0, 3])
        logits = graphed.forward(batch).clone()
        assert logits.dtype == torch.bfloat16
        rng = graphed.sampler.gumbel_rng.clone()  # the logits replay drew too: start from here
        in_graph = graphed.decode_tokens(batch, state.sampling)
        assert torch.equal(in_graph, gumbel_max_sample(logits, state.sampling.temperatures, rng))
        assert torch.equal(graphed.sampler.gumbel_rng, rng)
        eager.sampler.gumbel_rng.copy_(graphed.sampler.gumbel_rng)
        graphed_again = graphed.decode_tokens(batch, state.sampling).tolist()
        eager_tokens = eager.decode_tokens(batch, state.sampling).tolist()
        same = sum(a == b for a, b in zip(graphed_again, eager_tokens))
        assert same >= 4, (graphed_again, eager_tokens)  # bf16 logits of two GEMM shapes: a near tie may differ
