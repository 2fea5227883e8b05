"""`--disaggregation-enable-kv-checksum`: a checksum of a request's KV pages that both sides compute on their own pool.

The prefill sends it with the first token; the decode recomputes it over the pages it pre-allocated once the KV
has landed, so a page that arrived damaged (or never arrived) fails the request instead of decoding garbage.
It does not depend on how the heads are spread over tensor-parallel ranks: a CRC32 per KV head of the model (every
layer's K and V bytes of the pages, in the order listed), each rank computing its own heads', combined in head
order (`combined_checksum`).
"""

from __future__ import annotations

import zlib

import torch

from pdserve.mem_cache.kv_pool import KVPool


def head_checksums(pool: KVPool, pages: list[int], first_head: int) -> dict[int, int]:
    """The CRC32 of each head this pool holds over `pages`, keyed by the model's head index (`first_head` is the
    pool's first)."""
    page_size = pool.layout.page_size
    first_slots = torch.tensor(pages, dtype=torch.long)[:, None] * page_size
    slots = (first_slots + torch.arange(page_size)).flatten().to(pool.buffer.device)
    data = pool.buffer.index_select(2, slots).cpu()
    return {first_head + i: zlib.crc32(data[:, :, :, i].contiguous().view(torch.uint8).numpy())
            for i in range(pool.layout.num_kv_heads)}


def combined_checksum(per_head: dict[int, int]) -> int:
    """One checksum of every head's CRC32, in head order."""
    return zlib.crc32(b"".join(per_head[h].to_bytes(4, "little") for h in sorted(per_head)))
