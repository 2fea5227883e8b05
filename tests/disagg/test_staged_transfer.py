"""Staged KV writes (a prefill's packed pieces into the decode's receive staging, unpacked there) between real
processes over tcp: scattered pages on both sides land bit-exactly in bf16 and FP8 pools, and with tensor
parallelism each rank's heads land in the pool of the decode rank of the same index (staging takes whole tokens:
the same TP size on both sides)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from test_packed_transfer import (DST_PAGES_IN_POOL, HEADS, NUM_LAYERS, SRC_PAGES_IN_POOL, head_bytes, layout, moved,
                                  random_pool, remote_pool)

from transfer_peer import start_peer, stop_peer
from pdserve.disagg.head_map import rank_heads
from pdserve.disagg.transfer import KVRegion, coalesce_page_runs
from pdserve.disagg.transfer.base import StagedDestination
from pdserve.disagg.transfer.packing import KVMover, KVPiece
from pdserve.mem_cache.kv_pool import KVPool

DTYPES = pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 8), (torch.float8_e4m3fn, 8),
                                                     (torch.float8_e4m3fn, 6)], ids=["bf16", "fp8", "fp8-6-byte-heads"])


def scattered_both_sides(n: int, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return rng.sample(range(1, SRC_PAGES_IN_POOL), n), rng.sample(range(1, DST_PAGES_IN_POOL), n)


def staged_write(mover: KVMover, conn, hello, src: KVPool, room: int, src_pages, dst_pages, dst_layout,
                 groups: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The pages written into the peer's slot for `room` in page groups (a chunked prompt's pushes), then unpacked
    by the peer: its pool's bytes."""
    conn.send(("stage", room, len(dst_pages)))
    slot = StagedDestination(conn.recv(), len(dst_pages))
    for first, last in groups:
        piece = KVPiece(KVRegion(src.data_ptr, src.layout), KVRegion(hello["base"], dst_layout),
                        coalesce_page_runs(src_pages[first:last], dst_pages[first:last]), range(NUM_LAYERS),
                        staged=replace(slot, first_position=first))
        mover.write(hello["session"], [piece])
    return remote_pool(conn, dst_layout, ("unpack", room, dst_pages))


@DTYPES
def test_scattered_pages_round_trip_staged(sender, dtype, head_dim):
    """In one write and in three (page groups), one layer per write through a small staging arena too."""
    src_layout = layout(dtype, head_dim=head_dim)
    dst_layout = layout(dtype, num_pages=DST_PAGES_IN_POOL, head_dim=head_dim)
    proc, conn, hello = start_peer("tcp", "cpu", dst_layout)
    try:
        src = random_pool(src_layout, seed=21)
        sender.register(src.data_ptr, src.nbytes)
        src_pages, dst_pages = scattered_both_sides(15, seed=22)
        want = moved(src, src_pages, dst_pages, dst_layout)
        for room, (arena_bytes, groups) in enumerate([(1 << 20, ((0, 15),)),
                                                      (1 << 20, ((0, 4), (4, 11), (11, 15))),
                                                      (2 * 15 * src_layout.page_bytes, ((0, 15),))]):
            mover = KVMover(sender, "cpu", arena_bytes, timeout_s=10)
            remote_pool(conn, dst_layout, "zero")
            got = staged_write(mover, conn, hello, src, room, src_pages, dst_pages, dst_layout, groups)
            assert torch.equal(got, want), f"arena {arena_bytes} B, groups {groups}"
            assert mover.arena.bytes_in_use == 0
    finally:
        stop_peer(proc, conn)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_tensor_parallel_ranks_round_trip_staged(sender, dtype):
    """Prefill TP 2 -> decode TP 2: each prefill rank writes its own heads, whole tokens of its pool, into the slot
    of the decode rank that holds the same heads; each decode pool ends up with exactly its heads of the model's KV."""
    tp = 2
    model = random_pool(layout(dtype), seed=23)
    rank_layout = layout(dtype, heads=HEADS // tp)
    dst_layout = layout(dtype, heads=HEADS // tp, num_pages=DST_PAGES_IN_POOL)
    mover = KVMover(sender, "cpu", 1 << 20, timeout_s=10)
    peers = [start_peer("tcp", "cpu", dst_layout) for _ in range(tp)]
    pools = []  # alive while registered with the sender
    try:
        src_pages, dst_pages = scattered_both_sides(13, seed=24)
        for r, (_, conn, hello) in enumerate(peers):
            heads = rank_heads(HEADS, tp, r)
            pool = KVPool(rank_layout, "cpu")
            pools.append(pool)
            head_bytes(pool).copy_(head_bytes(model)[:, :, :, heads.start : heads.stop])
            sender.register(pool.data_ptr, pool.nbytes)
            got = staged_write(mover, conn, hello, pool, 40 + r, src_pages, dst_pages, dst_layout, ((0, 6), (6, 13)))
            want = moved(model, src_pages, dst_pages, dst_layout, src_heads=slice(heads.start, heads.stop))
            assert torch.equal(got, want), f"decode rank {r}"
        assert mover.arena.bytes_in_use == 0
    finally:
        for proc, conn, _ in peers:
            stop_peer(proc, conn)
