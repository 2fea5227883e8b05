"""The host KV pool: device ↔ host copies of scattered pages, and one block format for both memory layouts."""

from __future__ import annotations

import pytest
import torch

from pdserve.mem_cache.host_pool import HostKVPool
from pdserve.mem_cache.kv_pool import KVLayout, KVPool

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, page_size=4, num_pages=12, dtype=torch.float32)


def filled_device_pool() -> KVPool:
    pool = KVPool(LAYOUT, "cpu")
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=torch.Generator().manual_seed(0)))
    return pool


def page(pool: KVPool, p: int) -> torch.Tensor:
    ps = LAYOUT.page_size
    return pool.buffer[:, :, p * ps : (p + 1) * ps]


@pytest.mark.parametrize("mem_layout", ["layer_first", "page_first"])
def test_save_then_load_moves_each_page_to_its_pair(mem_layout):
    device = filled_device_pool()
    host = HostKVPool(LAYOUT, 8, mem_layout, pin=False)
    src, slots = [3, 4, 5, 9, 1], [2, 3, 4, 6, 7]  # runs of different lengths on both sides
    host.save(device, src, slots)
    fresh = KVPool(LAYOUT, "cpu")
    dst = [10, 11, 2, 6, 7]
    host.load(fresh, slots, dst)
    for s, d in zip(src, dst):
        assert torch.equal(page(fresh, d), page(device, s))
    assert page(fresh, 8).abs().sum() == 0  # nothing else was written


def test_block_payload_is_the_same_in_both_layouts():
    device = filled_device_pool()
    pools = [HostKVPool(LAYOUT, 4, layout, pin=False) for layout in ("layer_first", "page_first")]
    for pool in pools:
        pool.save(device, [5], [2])
    payloads = [pool.read_page(2) for pool in pools]
    assert payloads[0] == payloads[1] and len(payloads[0]) == pools[0].page_nbytes
    pools[1].write_page(1, payloads[0])
    assert pools[1].read_page(1) == payloads[0]
