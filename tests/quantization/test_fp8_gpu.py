"""On a GPU with FP8 tensor cores: the engine with `--quantization fp8` (decode in CUDA graphs, GEMMs through
`torch._scaled_mm`) agrees with the same FP8 model through the dequantizing fallback, and its weights take about
half the memory of bf16's, which the KV budget gets."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from fp8_kinds import one_candidate_of_each_kind

pytestmark = pytest.mark.fp8_gpu

# Both round their bf16 outputs once, after sums in another order; a one-ulp bf16 difference that flips one
# activation's E4M3 rounding (3 mantissa bits: a 6% step) in a later layer grows through a random-weight model's
# 28 layers (H200, 2026-11-27: a mean gap of 0.175). Wrong scales or layouts give gaps of whole nats.
MEAN_LOGPROB_GAP = 0.5


@pytest.fixture(scope="module")
def qwen3_06b(tiny_models):
    return tiny_models["qwen3-0.6b"]


@pytest.fixture(autouse=True)
def lean_fp8_tuner(monkeypatch):
    """The engines' FP8 tuner times one candidate of each kind: every candidate of each epilogue, a compile apiece
    on a cold Triton cache, took the FP8 engine's start past a minute; the sweep of all is `-m tuner_sweep`'s (the
    tuning cache keys its choices by the candidate list, so these are never taken for the full tuner's)."""
    from pdserve.quantization import fp8

    monkeypatch.setattr(fp8, "fp8_candidates", one_candidate_of_each_kind)


def test_scaled_mm_engine_agrees_with_the_fallback(qwen3_06b, monkeypatch):
    from pdserve import LLM, SamplingParams
    from pdserve.quantization import fp8

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 100000) for _ in range(n)] for n in (7, 120, 600)]
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, logprob_start_len=0)

    def prompt_logprobs(llm, sequences):
        return torch.tensor([lp for out in llm.generate(sequences, score, use_tqdm=False)
                             for lp in out.prompt_logprobs[1:]])

    # graphs of one row: the FP8 tuner compiles its candidates for that row count alone (each row count it tunes
    # costs a cold start tens of seconds); each prompt decodes alone, in the graph
    llm = LLM(qwen3_06b, device="cuda", quantization="fp8", max_total_tokens=65536, cuda_graph_max_bs=1,
              skip_server_warmup=True)
    assert llm.scheduler.runner.graph_runner is not None
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = [llm.generate([prompt], greedy, use_tqdm=False)[0] for prompt in prompts]
    sequences = [prompt + out.token_ids for prompt, out in zip(prompts, outs)]
    fast = prompt_logprobs(llm, sequences)
    llm.shutdown()
    monkeypatch.setattr(fp8, "has_fp8_gemm", lambda device: False)
    fallback = LLM(qwen3_06b, device="cuda", quantization="fp8", max_total_tokens=65536, cuda_graph_max_bs=1,
                   skip_server_warmup=True)
    slow = prompt_logprobs(fallback, sequences)
    fallback.shutdown()
    assert fast.shape == slow.shape == (sum(len(s) - 1 for s in sequences),)
    assert (fast - slow).abs().mean() < MEAN_LOGPROB_GAP, (fast - slow).abs().mean()


def _kv_tokens_and_linear_bytes(path: str, quantization: str | None) -> tuple[int, int]:
    from pdserve import LLM

    # one graph of one row rather than eager (which tunes FP8 rows 1 to 8): the KV budget is set before either
    llm = LLM(path, device="cuda", quantization=quantization, mem_fraction_static=0.5, cuda_graph_max_bs=1,
              skip_server_warmup=True)
    try:
        linear_bytes = sum(p.numel() * p.element_size() for n, p in llm.scheduler.runner.model.named_parameters()
                           if "proj" in n)
        return llm.scheduler.model_info["max_total_tokens"], linear_bytes
    finally:
        llm.shutdown()


def test_fp8_weights_leave_room_for_more_kv(qwen3_06b):
    bf16_tokens, bf16_bytes = _kv_tokens_and_linear_bytes(qwen3_06b, None)
    gc.collect()
    torch.cuda.empty_cache()  # the first engine's memory back to the device before the second measures it
    fp8_tokens, fp8_bytes = _kv_tokens_and_linear_bytes(qwen3_06b, "fp8")
    assert fp8_bytes < 0.52 * bf16_bytes  # one byte per weight, plus a float32 scale per row
    kv_bytes_per_token = 2 * 28 * 8 * 128 * 2  # (K, V) x layers x KV heads x head_dim x bf16
    # most of the freed bytes: each weight tensor's allocation rounds up to the allocator's block, which costs the
    # half-size FP8 tensors relatively more (H200, 2026-11-27: 89.9% of the freed bytes became KV pages)
    assert fp8_tokens - bf16_tokens >= 0.85 * (bf16_bytes - fp8_bytes) / kv_bytes_per_token
