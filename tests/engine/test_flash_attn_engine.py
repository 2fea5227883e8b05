"""On one GPU with FlashAttention-4: `auto` serves through the flash_attn backend, and its greedy bf16 output follows
the triton backend's on the exact-shape qwen3-0.6b preset (qwen3-tiny's head_dim 32 is one the Triton decode lacks)
through fresh prompts, chunked prefill and radix-cache hits.

bf16 rounding differs between the two attention kernels, so the tolerance is the one tests/engine's bf16 test
uses: the two outputs may part only where the triton run's own top-2 margin is under 0.5 logits (a near-tie);
after that they are not compared.
"""

from __future__ import annotations

import random

import pytest

from pdserve.attention.selection import flash_attn_installed
from pdserve.forward_batch import ForwardBatch, ForwardMode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not flash_attn_installed(), reason="flash_attn.cute (FlashAttention-4) not installed"),
]

MARGIN = 0.5


def prompts() -> tuple[list[list[int]], list[list[int]]]:
    """A first round (short and long prompts, two longer than a 256-token chunk) and a second that shares the
    first 512 tokens of one of them (a radix hit: extends on top of a cached prefix)."""
    rng = random.Random(0)
    first = [[rng.randrange(100, 100000) for _ in range(n)] for n in (7, 120, 600, 1500)]
    second = [first[2][:512] + [rng.randrange(100, 100000) for _ in range(n)] for n in (5, 300)]
    return first, second


def generate(qwen3_06b: str, backend: str):
    from pdserve import LLM, SamplingParams

    llm = LLM(qwen3_06b, device="cuda", dtype="bfloat16", attention_backend=backend, max_total_tokens=65536,
              chunked_prefill_size=256)
    extends: list[tuple[int, ...]] = []

    def observe(batch: ForwardBatch) -> None:
        if batch.mode == ForwardMode.EXTEND:
            extends.append(tuple(batch.prefix_lens_cpu))

    llm.scheduler.runner.forward_observers.append(observe)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    outs = [out for batch in prompts() for out in llm.generate(batch, params, use_tqdm=False)]
    assert llm.scheduler.kv_pool_is_fully_free()
    backend_name = llm.scheduler.runner.backend_name
    llm.shutdown()
    return backend_name, outs, extends


def test_flash_attn_greedy_follows_triton(tiny_models):
    qwen3_06b = tiny_models["qwen3-0.6b"]
    backend_name, flash, extends = generate(qwen3_06b, "auto")
    assert backend_name == "flash_attn"
    assert any(not any(prefixes) for prefixes in extends)  # FlashAttention-4's fresh call
    assert any(any(prefixes) for prefixes in extends)  # and its paged one (later chunks, radix hits)
    assert flash[4].cached_tokens >= 256 and flash[5].cached_tokens >= 256
    _, triton, _ = generate(qwen3_06b, "triton")
    compared = 0
    for f, t in zip(flash, triton):
        for i, (mine, theirs) in enumerate(zip(f.token_ids, t.token_ids)):
            if mine != theirs:
                (_, best), (_, second) = t.top_logprobs[i][:2]
                assert best - second < MARGIN, f"parted at a clear margin ({best - second:.2f}) at position {i}"
                break
            compared += 1
    assert compared >= 24, f"only {compared} positions before the outputs parted"
