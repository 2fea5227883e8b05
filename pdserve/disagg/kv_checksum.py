"""`--disaggregation-enable-kv-checksum`: a CRC32 over a request's KV pages that both sides compute on their own pool.

The prefill sends it with the first token; the decode recomputes it over the pages it pre-allocated once the KV
has landed, so a page that arrived damaged (or never arrived) fails the request instead of decoding garbage.
"""

from __future__ import annotations

import zlib

import torch

from pdserve.mem_cache.kv_pool import KVPool


def pages_checksum(pool: KVPool, pages: list[int]) -> int:
    """CRC32 of every layer's K and V bytes of `pages`, taken in the order the pages are listed."""
    page_size = pool.layout.page_size
    first_slots = torch.tensor(pages, dtype=torch.long)[:, None] * page_size
    slots = (first_slots + torch.arange(page_size)).flatten().to(pool.buffer.device)
    data = pool.buffer.index_select(2, slots).contiguous().cpu()
    return zlib.crc32(data.view(torch.uint8).numpy())
