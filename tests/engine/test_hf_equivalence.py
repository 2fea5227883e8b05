"""Greedy generation matches HF transformers token for token (fp32, CPU)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams

TINY_PRESETS = ("llama-tiny", "qwen2-tiny", "qwen3-tiny")

MAX_NEW = 16


def hf_greedy(model, prompt: list[int], n: int = MAX_NEW) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def random_prompts(lengths, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=TINY_PRESETS)
def pair(request, tiny_models):
    path = tiny_models[request.param]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    llm = LLM(path, device="cpu", dtype="float32", page_size=4, chunked_prefill_size=48, max_prefill_tokens=48,
              max_total_tokens=8192)
    return hf, llm


def greedy(n=MAX_NEW, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def test_single_and_mixed_batch_match_hf(pair):
    hf, llm = pair
    prompts = random_prompts([1, 5, 17, 33, 64], hf.config.vocab_size)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt)
        assert out.finish_reason["type"] == "length"
    assert llm.scheduler.kv_pool_is_fully_free()


def test_prompt_longer_than_chunk_matches_hf(pair):
    hf, llm = pair
    (prompt,) = random_prompts([150], hf.config.vocab_size, seed=1)  # > chunked_prefill_size=48: 4 chunks
    assert llm.generate([prompt], greedy(), use_tqdm=False)[0].token_ids == hf_greedy(hf, prompt)


def test_radix_cache_hit_matches_hf(pair):
    hf, llm = pair
    base = random_prompts([70], hf.config.vocab_size, seed=2)[0]
    llm.generate([base], greedy(4), use_tqdm=False)
    hits_before = llm.scheduler.stats()["prefix_hit_tokens"]
    # shares 70 tokens of prefix, which ends mid-page (page_size 4) and mid-chunk (chunk 48)
    extended = base + random_prompts([61], hf.config.vocab_size, seed=3)[0]
    out = llm.generate([extended], greedy(), use_tqdm=False)[0]
    assert out.cached_tokens >= 64
    assert llm.scheduler.stats()["prefix_hit_tokens"] > hits_before
    assert out.token_ids == hf_greedy(hf, extended)
    assert llm.scheduler.kv_pool_is_fully_free()
