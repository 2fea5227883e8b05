"""Tier 2: prefixes evicted from a tiny device pool come back from host memory, HF-identical."""

from __future__ import annotations

import pytest
from hicache_util import assert_pools_free, hicache, prompts, run, tiered_llm

from pdserve.config import ConfigError, ServerArgs
from pdserve.mem_cache.host_pool import MEM_LAYOUTS


@pytest.mark.parametrize("mem_layout", MEM_LAYOUTS)
@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
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
    assert hicache(llm, "load_copy_seconds_total", "host") > 0
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


def test_flush_cache_empties_both_tiers(tiny_model):
    llm = tiered_llm(tiny_model)
    for prompt in prompts(64, 64, 64, seed=2):
        run(llm, prompt)
    radix = llm.scheduler.radix
    assert radix.host.allocator.num_free < radix.host.allocator.capacity
    assert llm.scheduler.flush_cache()
    assert radix.num_pages == 0 and radix.host.allocator.num_free == radix.host.allocator.capacity
    assert_pools_free(llm)


@pytest.mark.parametrize("flags, message", [
    ({"hicache_write_policy": "write_around"}, "--hicache-write-policy"),
    ({"hicache_storage_backend": "file"}, "needs --enable-hierarchical-cache"),
    ({"enable_hierarchical_cache": True, "hicache_storage_backend": "mooncake"}, "master_server_address"),
    ({"enable_hierarchical_cache": True, "hicache_storage_backend": "file",
      "hicache_storage_backend_extra_config": "[1]"}, "JSON object"),
    ({"hicache_ratio": 0.0}, "--hicache-ratio"),
    ({"hicache_mem_layout": "page_head"}, "--hicache-mem-layout"),
])
def test_bad_hicache_flags_are_refused(tiny_model, flags, message):
    with pytest.raises(ConfigError, match=message):
        ServerArgs(model_path=tiny_model, **flags)
