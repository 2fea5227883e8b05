"""Tensor parallelism on two GPUs (NCCL, CUDA graphs on): TP 2 generates exactly what TP 1 does in float32, and
within a small prompt-logprob difference in bf16, on the exact-shape qwen3-0.6b preset. Each engine runs in a process
of its own under a time limit (tensor_parallel_child.py), so that a hang or an abort in one, its NCCL teardown
included, fails its test with the engine's output; its follower ranks must exit on their own at shutdown."""

from __future__ import annotations

import random

import pytest
import torch
from tensor_parallel_child import run_engine

pytestmark = pytest.mark.multi_gpu  # implies gpu; skipped below two GPUs (tests/conftest.py)

NUM_PROMPTS = 48
MAX_NEW = 24
ENGINE_LIMIT_S = 150  # one engine's start, graph capture, run and shutdown; two fit the per-test 320 s


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(100, vocab - 1) for _ in range(rng.randrange(8, 400))] for _ in range(NUM_PROMPTS)]


def generate(path: str, tp_size: int, dtype: str, inputs: list[list[int]], tmp_path) -> dict:
    engine = {"device": "cuda", "dtype": dtype, "tp_size": tp_size, "max_total_tokens": 32768,
              "chunked_prefill_size": 256, "skip_server_warmup": True, "cuda_graph_max_bs": NUM_PROMPTS}
    result = run_engine(path, engine, inputs, MAX_NEW, tmp_path / f"tp{tp_size}_{dtype}", ENGINE_LIMIT_S)
    assert result["pool_free"]
    assert result["follower_exit_codes"] == [0] * (tp_size - 1), "a follower did not leave the group on its own"
    return result


@pytest.fixture(scope="module")
def qwen3_06b(tiny_models):
    return tiny_models["qwen3-0.6b"]


def test_tp2_float32_greedy_equals_tp1(qwen3_06b, tmp_path):
    from transformers import AutoConfig

    inputs = prompts(AutoConfig.from_pretrained(qwen3_06b).vocab_size)
    one = generate(qwen3_06b, 1, "float32", inputs, tmp_path)["outputs"]
    two = generate(qwen3_06b, 2, "float32", inputs, tmp_path)["outputs"]
    differing = [i for i, (a, b) in enumerate(zip(one, two)) if a != b]
    assert not differing, f"{len(differing)}/{NUM_PROMPTS} prompts differ, first: {differing[0]}"


def test_tp2_bf16_prompt_logprobs_close_to_tp1(qwen3_06b, tmp_path):
    from transformers import AutoConfig

    inputs = prompts(AutoConfig.from_pretrained(qwen3_06b).vocab_size)
    one = generate(qwen3_06b, 1, "bfloat16", inputs, tmp_path)["prompt_logprobs"]
    two = generate(qwen3_06b, 2, "bfloat16", inputs, tmp_path)["prompt_logprobs"]
    diffs = torch.tensor([abs(a - b) for x, y in zip(one, two) for a, b in zip(x, y, strict=True)])
    assert diffs.numel() > 1000
    assert diffs.mean().item() <= 0.02, f"mean |logprob TP 2 - TP 1| {diffs.mean().item():.4f}"
