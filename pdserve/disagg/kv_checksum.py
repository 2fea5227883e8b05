"""`--disaggregation-enable-kv-checksum`: a checksum of a request's KV pages that both sides compute on their own pool.

The prefill sends it with the first token; the decode recomputes it over the pages it pre-allocated once the KV
has landed, so a page that arrived damaged, in the wrong place or not at all fails the request instead of decoding
garbage. It does not depend on how the heads are spread over tensor-parallel ranks: one value per KV head of the
model (every layer's K and V bytes of the pages, in the order listed), each rank computing its own heads', combined
in head order (`combined_checksum`).

Each head's value is a position-weighted sum of its 16-bit words modulo the prime 2^31 - 1, computed on the pool's
device in int64 without overflow (words < 2^16, weights < 2^31), a few layers at a time: only one int per head
leaves the device. Every weight is nonzero modulo the prime, so any single changed word changes the sum, a word
moved to another position almost surely does (weights differ by position), and two independent errors cancel with
probability about 2^-31 per head. It guards against transport faults, not against a peer forging bytes.
"""

from __future__ import annotations

import zlib

import torch

from pdserve.mem_cache.kv_pool import KVPool

MODULUS = (1 << 31) - 1
CHUNK_BYTES = 32 << 20  # of pool data hashed at once (its int64 copy is four times that)
_WEIGHT_MULTIPLIER, _WEIGHT_OFFSET = 1_103_515_245, 12_345


def weights(positions: torch.Tensor) -> torch.Tensor:
    """A nonzero weight below MODULUS for each position (int64, any size)."""
    return ((positions % MODULUS) * _WEIGHT_MULTIPLIER + _WEIGHT_OFFSET) % (MODULUS - 1) + 1


def head_checksums(pool: KVPool, pages: list[int], first_head: int) -> dict[int, int]:
    """The checksum of each head this pool holds over `pages`, keyed by the model's head index (`first_head` is the
    pool's first)."""
    layout, device = pool.layout, pool.buffer.device
    page_size = layout.page_size
    first_slots = torch.tensor(pages, dtype=torch.long)[:, None] * page_size
    slots = (first_slots + torch.arange(page_size)).flatten().to(device)
    head_bytes = layout.head_dim * layout.itemsize
    words = pool.buffer.view(torch.uint8).view(2 * layout.num_layers, layout.num_slots, layout.num_kv_heads, head_bytes)
    if head_bytes % 2 == 0:
        words = words.view(torch.int16)
    column_weights = weights(torch.arange(words.shape[-1], device=device))
    per_layer = len(slots) * layout.num_kv_heads * head_bytes
    step = max(1, CHUNK_BYTES // max(per_layer, 1))
    total = torch.zeros(layout.num_kv_heads, dtype=torch.int64, device=device)
    for start in range(0, 2 * layout.num_layers, step):
        block = words[start : start + step].index_select(1, slots).to(torch.int64) & 0xFFFF  # [layers, slots, H, W]
        rows = (block * column_weights).sum(-1) % MODULUS  # [layers, slots, H]
        row_index = torch.arange(start * len(slots), start * len(slots) + rows.shape[0] * rows.shape[1], device=device)
        total += ((rows.flatten(0, 1) * weights(row_index)[:, None]) % MODULUS).sum(0)
        total %= MODULUS
    return {first_head + i: int(v) for i, v in enumerate(total.tolist())}


def combined_checksum(per_head: dict[int, int]) -> int:
    """One checksum of every head's value, in head order."""
    return zlib.crc32(b"".join(per_head[h].to_bytes(4, "little") for h in sorted(per_head)))
