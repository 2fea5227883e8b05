"""Tier 2: prefixes evicted from a tiny device pool come back from host memory, HF-identical."""

from __future__ import annotations

import pytest
from conftest import assert_pools_free, hicache, prompts, run, tiered_llm


@pytest.mark.parametrize("write_policy, mem_layout", [("write_back", "layer_first"), ("write_through", "page_first")])
def test_prefix_evicted_from_device_is_served_from_host(tiny_model, hf_greedy, write_policy, mem_layout):
    llm = tiered_llm(tiny_model, hicache_write_policy=write_policy, hicache_mem_layout=mem_layout)
    base, other1, other2 = prompts(64, 64, 64)
    run(llm, base)
    run(llm, other1)
    run(llm, other2)  # the device pool (39 pages) cannot keep base's 16 pages next to these
    followup = base + [7, 8, 9]
    out = run(llm, followup)
    assert out.cached_tokens == 64
    assert hicache(llm, "hit_tokens_total", "host") > 0
    assert hicache(llm, "loaded_bytes_total", "host") > 0
    assert out.token_ids == hf_greedy(followup)
    assert_pools_free(llm)


def test_host_tier_evicts_its_own_lru_pages(tiny_model, hf_greedy):
    llm = tiered_llm(tiny_model, hicache_ratio=0.5, hicache_write_policy="write_back")  # 19 host pages
    batch = prompts(64, 64, 64, 64, seed=1)
    for prompt in batch:
        run(llm, prompt)
    radix = llm.scheduler.radix
    assert radix.host.allocator.num_free <= 1  # the host tier filled up and evicted
    assert_pools_free(llm)
    for prompt in (batch[0], batch[-1]):  # the oldest is gone from every tier, the newest is cached
        followup = prompt + [11]
        assert run(llm, followup).token_ids == hf_greedy(followup)
    assert_pools_free(llm)
