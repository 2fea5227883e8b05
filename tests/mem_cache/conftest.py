"""Fixtures for the KV-cache tier tests: a tiny random model, its HF twin for greedy references, engines."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from pdserve.tools.make_model import make_model

PAGE_SIZE = 4
SMALL_POOL_TOKENS = 160  # 39 pages: three 64-token prompts do not fit together, so older prefixes get evicted
MAX_NEW = 8


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(make_model("llama-tiny", tmp_path_factory.mktemp("models") / "llama-tiny", seed=0))


@pytest.fixture(scope="session")
def hf_greedy(tiny_model):
    """Greedy continuation of a prompt by HF transformers (fp32, eager attention): the reference output."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="eager").eval()

    def run(prompt: list[int], n: int = MAX_NEW) -> list[int]:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        return out[0, len(prompt):].tolist()

    return run


def tiered_llm(model: str, **kw) -> LLM:
    args = dict(device="cpu", dtype="float32", page_size=PAGE_SIZE, max_total_tokens=SMALL_POOL_TOKENS,
                enable_hierarchical_cache=True, disable_overlap_schedule=True)
    return LLM(model, **{**args, **kw})


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run(llm: LLM, prompt: list[int]):
    return llm.generate([prompt], greedy(), use_tqdm=False)[0]


def hicache(llm: LLM, name: str, tier: str) -> float:
    return llm.scheduler.stats()["hicache"][f"pdserve_hicache_{name}"][tier]


def assert_pools_free(llm: LLM) -> None:
    sched = llm.scheduler
    assert sched.kv_pool_is_fully_free()
    assert sched.radix.host_pool_is_consistent()
