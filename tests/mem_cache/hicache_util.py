"""Helpers of the KV-cache tier tests: engines with a tiny device pool, prompts, tier counters, pool checks."""

from __future__ import annotations

import random

from pdserve import LLM, SamplingParams

PAGE_SIZE = 4
SMALL_POOL_TOKENS = 160  # 39 pages: three 64-token prompts do not fit together, so older prefixes get evicted
MAX_NEW = 8


def tiered_llm(model: str, **kw) -> LLM:
    args = dict(device="cpu", dtype="float32", page_size=PAGE_SIZE, max_total_tokens=SMALL_POOL_TOKENS,
                enable_hierarchical_cache=True, disable_overlap_schedule=True,
                skip_server_warmup=True)  # the tests count every block stored and found: no warm-up prompts
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
    host_nodes = sum(1 for n in sched.radix._nodes() if n.host_page >= 0)
    assert sched.stats()["hicache_host_cached_tokens"] == host_nodes * sched.page_size
