"""The KV checksum a decode compares before it commits a request: the same over any tensor-parallel split of the
heads, and changed by any damage a transport can do (a flipped byte, a page in the wrong place, a page missing)."""

from __future__ import annotations

import pytest
import torch

from pdserve.disagg.kv_checksum import combined_checksum, head_checksums
from pdserve.mem_cache.kv_pool import KVLayout, KVPool

HEADS = 4


def random_pool(dtype: torch.dtype, head_dim: int, heads: int = HEADS, seed: int = 0) -> KVPool:
    pool = KVPool(KVLayout(num_layers=3, num_kv_heads=heads, head_dim=head_dim, page_size=4, num_pages=12,
                           dtype=dtype), "cpu")
    raw = pool.buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return pool


def checksum(pool: KVPool, pages: list[int]) -> int:
    return combined_checksum(head_checksums(pool, pages, 0))


@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 8), (torch.float8_e4m3fn, 8), (torch.float8_e4m3fn, 5)])
def test_any_damage_changes_the_checksum(dtype, head_dim):
    pool = random_pool(dtype, head_dim)
    pages = [3, 7, 1, 9]
    before = checksum(pool, pages)
    assert checksum(pool, pages) == before
    raw = pool.buffer.view(torch.uint8)
    for kv, layer, slot, head, byte in [(0, 0, 12, 0, 0), (1, 2, 39, 3, head_dim - 1), (1, 1, 5, 2, 1)]:
        original = raw[kv, layer, slot, head, byte].item()
        raw[kv, layer, slot, head, byte] = original ^ 0x10
        assert checksum(pool, pages) != before, (kv, layer, slot, head, byte)
        raw[kv, layer, slot, head, byte] = original
    assert checksum(pool, [7, 3, 1, 9]) != before  # two pages swapped
    swapped = random_pool(dtype, head_dim)
    swapped.buffer[0, 1], swapped.buffer[1, 1] = pool.buffer[1, 1].clone(), pool.buffer[0, 1].clone()
    assert checksum(swapped, pages) != before  # K and V of a layer exchanged
    pool.buffer.view(torch.uint8)[:, :, 28:32] = 0  # page 7 never arrived
    assert checksum(pool, pages) != before


def test_tensor_parallel_ranks_give_the_checksum_of_the_whole_pool():
    whole = random_pool(torch.bfloat16, 8, seed=1)
    pages = [2, 5, 11]
    per_head = {}
    for first in (0, 2):
        rank = random_pool(torch.bfloat16, 8, heads=2)
        rank.buffer.copy_(whole.buffer[:, :, :, first : first + 2])
        per_head.update(head_checksums(rank, pages, first))
    assert combined_checksum(per_head) == checksum(whole, pages)
    assert head_checksums(whole, pages, 0) == per_head
