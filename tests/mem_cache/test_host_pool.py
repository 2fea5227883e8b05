"""The host KV pool: device ↔ host copies of scattered pages, and one block format for both memory layouts."""

from __future__ import annotations

import pytest
import torch

from pdserve.mem_cache.hiradix_cache import HiCachePolicy, HiRadixCache
from pdserve.mem_cache.host_pool import MEM_LAYOUTS, HostKVPool
from pdserve.mem_cache.kv_pool import KVLayout, KVPool, PageAllocator

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, page_size=4, num_pages=12, dtype=torch.float32)
PAGE_NBYTES = 2 * LAYOUT.num_layers * LAYOUT.page_bytes
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # on CUDA: pinned host pool, asynchronous copies


def filled_device_pool(device: str = "cpu") -> KVPool:
    pool = KVPool(LAYOUT, device)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=torch.Generator().manual_seed(0)))
    return pool


def host_pool(num_pages: int, mem_layout: str, device: str, **kw) -> HostKVPool:
    return HostKVPool(LAYOUT, num_pages, mem_layout, pin=device == "cuda", **kw)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def page(pool: KVPool, p: int) -> torch.Tensor:
    ps = LAYOUT.page_size
    return pool.buffer[:, :, p * ps : (p + 1) * ps]


@pytest.mark.parametrize("device_type", DEVICES)
@pytest.mark.parametrize("mem_layout", MEM_LAYOUTS)
@pytest.mark.parametrize("staging_pages", [1, 2, 64], ids=["chunk1", "chunk2", "one-chunk"])
def test_save_then_load_moves_each_page_to_its_pair(mem_layout, staging_pages, device_type):
    device = filled_device_pool(device_type)
    host = host_pool(8, mem_layout, device_type, staging_bytes=staging_pages * PAGE_NBYTES)
    src, slots = [3, 4, 5, 9, 1], [2, 3, 4, 6, 7]  # runs of different lengths on both sides
    host.save(device, src, slots)
    fresh = KVPool(LAYOUT, device_type)
    dst = [10, 11, 2, 6, 7]
    host.load(fresh, slots, dst)
    synchronize(device_type)
    for s, d in zip(src, dst):
        assert torch.equal(page(fresh, d), page(device, s))
    untouched = [p for p in range(LAYOUT.num_pages) if p not in dst]
    assert all(page(fresh, p).abs().sum() == 0 for p in untouched)  # nothing else was written


@pytest.mark.parametrize("mem_layout", MEM_LAYOUTS)
def test_descending_and_interleaved_pages_land_in_order(mem_layout):
    """Device pages in any order (descending, as eviction frees them) against host runs in another order."""
    device = filled_device_pool()
    host = HostKVPool(LAYOUT, 10, mem_layout, pin=False, staging_bytes=3 * PAGE_NBYTES)
    src, slots = [11, 10, 9, 8, 7, 6, 5], [1, 2, 3, 8, 9, 5, 4]
    host.save(device, src, slots)
    fresh = KVPool(LAYOUT, "cpu")
    dst = [2, 4, 6, 8, 10, 3, 5]
    host.load(fresh, slots[::-1], dst[::-1])
    for s, d in zip(src, dst):
        assert torch.equal(page(fresh, d), page(device, s))


def test_block_payload_is_the_same_in_both_layouts():
    device = filled_device_pool()
    pools = [HostKVPool(LAYOUT, 4, layout, pin=False) for layout in MEM_LAYOUTS]
    for pool in pools:
        pool.save(device, [5], [2])
    payloads = [pool.read_page(2) for pool in pools]
    assert payloads[0] == payloads[1] and len(payloads[0]) == pools[0].page_nbytes
    assert payloads[0] == page(device, 5).contiguous().numpy().tobytes()  # [2, layers, page_size, heads, dim]
    for pool in pools:
        pool.write_page(1, payloads[0])
        assert pool.read_page(1) == payloads[0]


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="page_head"):
        HostKVPool(LAYOUT, 4, "page_head", pin=False)


def write_back_cache(device: KVPool, host_pages: int, mem_layout: str = "page_first"):
    allocator = PageAllocator(LAYOUT.num_pages)
    host = host_pool(host_pages, mem_layout, device.buffer.device.type)
    return allocator, HiRadixCache(allocator, device, host, None, b"test", HiCachePolicy(write_policy="write_back"))


def cache_chain(allocator: PageAllocator, cache: HiRadixCache, device: KVPool, tokens: list[int]) -> list:
    """Insert tokens' full pages (fresh device pages) and return a copy of each page's content."""
    pages = allocator.alloc(len(tokens) // LAYOUT.page_size)
    content = [page(device, p).clone() for p in pages]
    cache.insert(tokens, pages)
    allocator.free(pages)  # the cache keeps its own references
    return content


def test_write_back_with_a_short_host_keeps_the_root_side_of_a_chain():
    """Three free host pages for a four-page chain: the three pages nearest the root stay cached (a leaf-first
    backup would keep the deepest three and lose them all with the dropped first page)."""
    device = filled_device_pool()
    allocator, cache = write_back_cache(device, host_pages=4)
    tokens = list(range(100, 100 + 4 * LAYOUT.page_size))
    content = cache_chain(allocator, cache, device, tokens)
    assert cache.evict(4) == 4
    device.buffer.zero_()
    pages = cache.match_prefix(tokens + [0], len(tokens))
    assert len(pages) == 3
    assert all(torch.equal(page(device, p), c) for p, c in zip(pages, content))
    allocator.free(pages)
    assert cache.host_pool_is_consistent()


@pytest.mark.parametrize("device_type", DEVICES)
@pytest.mark.parametrize("mem_layout", MEM_LAYOUTS)
def test_write_back_gives_each_evicted_chain_one_host_run(mem_layout, device_type):
    """Eviction frees leaves first; the host pages it backs them up to still ascend along each prefix, so a
    prefix loaded back is one copy per chain, and the pages come back with their content (on CUDA through the
    load stream and the event the next forward waits on)."""
    device = filled_device_pool(device_type)
    allocator, cache = write_back_cache(device, host_pages=16, mem_layout=mem_layout)
    chains = {start: list(range(start * 100, start * 100 + 4 * LAYOUT.page_size)) for start in (1, 2)}
    originals = {tuple(tokens): cache_chain(allocator, cache, device, tokens) for tokens in chains.values()}
    assert cache.evict(8) == 8
    device.buffer.zero_()  # what comes back must come from the host
    for tokens in chains.values():
        path = cache._walk(tokens, 4, touch=False)
        hosts = [n.host_page for n in path]
        assert hosts == list(range(hosts[0], hosts[0] + 4)) and all(n.page < 0 for n in path)
    for tokens, content in originals.items():
        pages = cache.match_prefix(list(tokens) + [0], len(tokens))
        cache.wait_for_loads()
        synchronize(device_type)
        assert len(pages) == 4
        assert all(torch.equal(page(device, p), c) for p, c in zip(pages, content))
        allocator.free(pages)
    assert cache.host_pool_is_consistent()
