"""Which KV heads each prefill rank sends to each decode rank when the two sides run different TP sizes.

A side with TP size t holds `kv_heads_per_rank(H, t)` of the model's H KV heads on each rank, starting at
`kv_head_start(H, t, rank)`; when H < t every head is replicated on t / H ranks. A decode rank needs every head
it holds exactly once: of the prefill ranks holding a head, decode rank j takes it from holder j mod (number of
holders), so replicas share the sending and no byte is written twice.
"""

from __future__ import annotations

from functools import lru_cache

from pdserve.disagg.transfer.base import HeadSlice
from pdserve.distributed.tensor_parallel import kv_head_start, kv_heads_per_rank


def rank_heads(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The model's KV heads rank `rank` of a side with `tp_size` ranks holds, in the order of its pool."""
    start = kv_head_start(num_kv_heads, tp_size, rank)
    return range(start, start + kv_heads_per_rank(num_kv_heads, tp_size))


def sender_of(num_kv_heads: int, head: int, src_tp: int, dst_rank: int) -> int:
    """The prefill rank that sends `head` to decode rank `dst_rank`."""
    holders = [r for r in range(src_tp) if head in rank_heads(num_kv_heads, src_tp, r)]
    return holders[dst_rank % len(holders)]


@lru_cache(maxsize=256)  # a few distinct arguments per server, asked on every transfer request
def head_slices(num_kv_heads: int, src_tp: int, src_rank: int, dst_tp: int, dst_rank: int) -> tuple[HeadSlice, ...]:
    """The heads prefill rank `src_rank` writes into decode rank `dst_rank`'s pool, as runs of pool-local head
    indexes (empty when that decode rank takes nothing from this prefill rank)."""
    src_heads = rank_heads(num_kv_heads, src_tp, src_rank)
    dst_heads = rank_heads(num_kv_heads, dst_tp, dst_rank)
    slices: list[HeadSlice] = []
    for dst_index, head in enumerate(dst_heads):
        if head not in src_heads or sender_of(num_kv_heads, head, src_tp, dst_rank) != src_rank:
            continue
        src_index = head - src_heads.start
        last = slices[-1] if slices else None
        if last and last.src_head + last.count == src_index and last.dst_head + last.count == dst_index:
            slices[-1] = HeadSlice(last.src_head, last.dst_head, last.count + 1)
        else:
            slices.append(HeadSlice(src_index, dst_index, 1))
    return tuple(slices)
