"""Packed KV writes (transfer/packing.py) between real processes over the host-staged backends: scattered pages
gathered on the sender land bit-exactly in the receiver's pages, in bf16 and FP8 pools, across tensor-parallel head
layouts, and the staging arena is bounded and always given back."""

from __future__ import annotations

import random
import threading
from dataclasses import replace

import pytest
import torch

from transfer_peer import start_peer, stop_peer
from pdserve.disagg.head_map import head_slices, rank_heads
from pdserve.disagg.transfer import KVRegion, TransferError, coalesce_page_runs, make_transfer_engine
from pdserve.disagg.transfer.base import StagedDestination
from pdserve.disagg.transfer.packing import (KVMover, KVPiece, StagingArena, destination_runs, merged, saves_spans,
                                           split_piece)
from pdserve.mem_cache.kv_pool import KVLayout, KVPool

HEADS = 4
NUM_LAYERS = 3
PAGE = 4
SRC_PAGES_IN_POOL, DST_PAGES_IN_POOL = 48, 40


def layout(dtype: torch.dtype, heads: int = HEADS, num_pages: int = SRC_PAGES_IN_POOL, head_dim: int = 8) -> KVLayout:
    return KVLayout(num_layers=NUM_LAYERS, num_kv_heads=heads, head_dim=head_dim, page_size=PAGE,
                    num_pages=num_pages, dtype=dtype)


def scattered_pages(n: int, seed: int) -> tuple[list[int], list[int]]:
    """Source pages at random; destination pages in three runs, as the decode's allocator hands them out."""
    rng = random.Random(seed)
    src = rng.sample(range(1, SRC_PAGES_IN_POOL), n)
    dst = list(range(2, 2 + n // 3)) + list(range(20, 20 + n // 3)) + list(range(30, 30 + n - 2 * (n // 3)))
    return src, dst


def random_pool(kv_layout: KVLayout, seed: int) -> KVPool:
    pool = KVPool(kv_layout, "cpu")
    raw = pool.buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return pool


def remote_pool(conn, kv_layout: KVLayout, command: str | tuple = "dump") -> torch.Tensor:
    conn.send(command)
    return torch.frombuffer(bytearray(conn.recv()), dtype=torch.uint8).view(
        2, kv_layout.num_layers, kv_layout.num_slots, kv_layout.num_kv_heads, -1)


def head_bytes(pool: KVPool) -> torch.Tensor:
    """The pool's bytes as [K/V, layer, slot, head, byte] (FP8 values copied as bytes, NaN patterns included)."""
    return pool.buffer.view(torch.uint8).view(2, pool.layout.num_layers, pool.layout.num_slots,
                                              pool.layout.num_kv_heads, -1)


def moved(src: KVPool, src_pages, dst_pages, dst_layout: KVLayout, src_heads=slice(None), dst_heads=slice(None),
          into: torch.Tensor | None = None) -> torch.Tensor:
    """The receiver's pool bytes after `src_pages` of `src_heads` landed in `dst_pages` of `dst_heads`."""
    out = torch.zeros(2, dst_layout.num_layers, dst_layout.num_slots, dst_layout.num_kv_heads,
                      dst_layout.head_dim * dst_layout.itemsize, dtype=torch.uint8) if into is None else into
    data = head_bytes(src)
    for s, d in zip(src_pages, dst_pages):
        out[:, :, d * PAGE : (d + 1) * PAGE, dst_heads] = data[:, :, s * PAGE : (s + 1) * PAGE, src_heads]
    return out


@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 8), (torch.float8_e4m3fn, 8), (torch.float8_e4m3fn, 6)],
                         ids=["bf16", "fp8", "fp8-6-byte-heads"])
def test_scattered_pages_round_trip_packed(sender, dtype, head_dim):
    src_layout, dst_layout = layout(dtype, head_dim=head_dim), layout(dtype, num_pages=DST_PAGES_IN_POOL,
                                                                      head_dim=head_dim)
    proc, conn, hello = start_peer("tcp", "cpu", dst_layout)
    try:
        src = random_pool(src_layout, seed=1)
        sender.register(src.data_ptr, src.nbytes)
        mover = KVMover(sender, "cpu", 1 << 20, timeout_s=10)
        src_pages, dst_pages = scattered_pages(18, seed=2)
        piece = KVPiece(KVRegion(src.data_ptr, src_layout), KVRegion(hello["base"], dst_layout),
                        coalesce_page_runs(src_pages, dst_pages), range(NUM_LAYERS))
        assert saves_spans(piece) and len(destination_runs(piece.runs)) == 3
        assert mover.write(hello["session"], [piece]) == piece.nbytes == 2 * NUM_LAYERS * 18 * src_layout.page_bytes
        assert torch.equal(remote_pool(conn, dst_layout), moved(src, src_pages, dst_pages, dst_layout))
        assert mover.arena.bytes_in_use == 0
    finally:
        stop_peer(proc, conn)


def test_a_staged_write_unpacks_into_scattered_pages(sender):
    """Into the peer's receive staging, then unpacked there: the pages scattered on both sides land as in place,
    from two writes (the pages in two groups, as a chunked prompt pushes them)."""
    src_layout, dst_layout = layout(torch.bfloat16), layout(torch.bfloat16, num_pages=DST_PAGES_IN_POOL)
    proc, conn, hello = start_peer("tcp", "cpu", dst_layout)
    try:
        src = random_pool(src_layout, seed=9)
        sender.register(src.data_ptr, src.nbytes)
        mover = KVMover(sender, "cpu", 1 << 20, timeout_s=10)
        src_pages = random.Random(10).sample(range(1, SRC_PAGES_IN_POOL), 14)
        dst_pages = random.Random(11).sample(range(1, DST_PAGES_IN_POOL), 14)
        conn.send(("stage", 5, 14))
        slot = StagedDestination(conn.recv(), 14)
        for first, last in ((0, 6), (6, 14)):
            piece = KVPiece(KVRegion(src.data_ptr, src_layout), KVRegion(hello["base"], dst_layout),
                            coalesce_page_runs(src_pages[first:last], dst_pages[first:last]), range(NUM_LAYERS),
                            staged=replace(slot, first_position=first))
            mover.write(hello["session"], [piece])
        got = remote_pool(conn, dst_layout, ("unpack", 5, dst_pages))
        assert torch.equal(got, moved(src, src_pages, dst_pages, dst_layout))
    finally:
        stop_peer(proc, conn)


def test_packed_and_in_place_writes_land_the_same_bytes(sender):
    """Each layer as its own piece (the layer-wise push), one write packed, one in place, and one through a staging
    arena so small that every page travels in a write of its own: the same bytes each time."""
    src_layout, dst_layout = layout(torch.bfloat16), layout(torch.bfloat16, num_pages=DST_PAGES_IN_POOL)
    proc, conn, hello = start_peer("tcp", "cpu", dst_layout)
    try:
        src = random_pool(src_layout, seed=3)
        sender.register(src.data_ptr, src.nbytes)
        mover = KVMover(sender, "cpu", 4 * src_layout.page_bytes, timeout_s=10)
        src_pages, dst_pages = scattered_pages(12, seed=4)
        runs = coalesce_page_runs(src_pages, dst_pages)
        pieces = [KVPiece(KVRegion(src.data_ptr, src_layout), KVRegion(hello["base"], dst_layout), runs,
                          range(layer, layer + 1)) for layer in range(NUM_LAYERS)]
        assert len(split_piece(pieces[0], mover.max_chunk)) == 12  # one page, K and V, per part
        want = moved(src, src_pages, dst_pages, dst_layout)
        for pack in (True, False, None):
            remote_pool(conn, dst_layout, "zero")
            mover.write(hello["session"], pieces, pack=pack)
            assert torch.equal(remote_pool(conn, dst_layout), want), f"pack={pack}"
    finally:
        stop_peer(proc, conn)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_tensor_parallel_head_layouts_round_trip_packed(sender, prefill_tp, decode_tp, dtype):
    """Every prefill rank packs the heads `head_slices` gives it for each decode rank; each decode rank's pool
    ends up holding exactly its own heads of the model's KV in the destination pages."""
    model = random_pool(layout(dtype), seed=5)  # the model's KV, all heads
    ranks = [rank_heads(HEADS, prefill_tp, r) for r in range(prefill_tp)]
    sources = []
    for heads in ranks:
        pool = KVPool(layout(dtype, heads=len(heads)), "cpu")
        head_bytes(pool).copy_(head_bytes(model)[:, :, :, heads.start : heads.stop])
        sender.register(pool.data_ptr, pool.nbytes)
        sources.append(pool)
    mover = KVMover(sender, "cpu", 1 << 20, timeout_s=10)
    dst_layout = layout(dtype, heads=HEADS // decode_tp, num_pages=DST_PAGES_IN_POOL)
    peers = [start_peer("tcp", "cpu", dst_layout) for _ in range(decode_tp)]
    try:
        src_pages, dst_pages = scattered_pages(15, seed=6)
        runs = coalesce_page_runs(src_pages, dst_pages)
        for r, pool in enumerate(sources):
            for j, (_, _, hello) in enumerate(peers):
                heads = head_slices(HEADS, prefill_tp, r, decode_tp, j)
                if heads:
                    piece = KVPiece(KVRegion(pool.data_ptr, pool.layout), KVRegion(hello["base"], dst_layout), runs,
                                    range(NUM_LAYERS), heads)
                    mover.write(hello["session"], [piece], pack=True)
        for j, (_, conn, _) in enumerate(peers):
            mine = rank_heads(HEADS, decode_tp, j)
            want = moved(model, src_pages, dst_pages, dst_layout, src_heads=slice(mine.start, mine.stop))
            assert torch.equal(remote_pool(conn, dst_layout), want), f"decode rank {j}"
        assert mover.arena.bytes_in_use == 0
    finally:
        for proc, conn, _ in peers:
            stop_peer(proc, conn)


def test_a_failed_packed_write_gives_its_staging_back(sender):
    src_layout = layout(torch.bfloat16)
    src = random_pool(src_layout, seed=7)
    sender.register(src.data_ptr, src.nbytes)
    short = make_transfer_engine("tcp", "cpu", timeout_s=0.5)
    try:
        short.register(src.data_ptr, src.nbytes)
        mover = KVMover(short, "cpu", 1 << 20, timeout_s=1)
        src_pages, dst_pages = scattered_pages(9, seed=8)
        piece = KVPiece(KVRegion(src.data_ptr, src_layout), KVRegion(1 << 40, layout(torch.bfloat16)),
                        coalesce_page_runs(src_pages, dst_pages), range(NUM_LAYERS))
        with pytest.raises(TransferError, match="no write ack"):
            mover.write("127.0.0.1:9", [piece], pack=True)  # nobody listens there
        assert mover.arena.bytes_in_use == 0
        bad = KVPiece(piece.src, piece.dst, [(SRC_PAGES_IN_POOL, 1, 1)], range(NUM_LAYERS))
        with pytest.raises(TransferError, match="out of range"):
            mover.write("127.0.0.1:9", [bad], pack=True)  # refused before any byte is gathered
        assert mover.arena.bytes_in_use == 0
    finally:
        short.close()


def test_a_full_arena_holds_writers_back_until_space_frees_then_times_out():
    arena = StagingArena(4096, timeout_s=5)
    first = arena.acquire(3000)
    got = []
    waiter = threading.Thread(target=lambda: got.append(arena.acquire(2048)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # back-pressure: 1,024 B free of 4,096
    arena.release(first)
    waiter.join(5)
    assert got == [0] and arena.bytes_in_use == 2048
    impatient = StagingArena(4096, timeout_s=0.1)
    impatient.acquire(4096)
    with pytest.raises(TransferError, match="no 256 B of KV staging came free within 0.1s"):
        impatient.acquire(1)
    with pytest.raises(TransferError, match="cannot stage"):
        impatient.acquire(8192)


def test_packing_only_where_it_saves_spans():
    src, dst = KVRegion(1 << 20, layout(torch.bfloat16)), KVRegion(1 << 30, layout(torch.bfloat16))
    contiguous = KVPiece(src, dst, coalesce_page_runs(list(range(5, 15)), list(range(1, 11))), range(NUM_LAYERS))
    scattered = KVPiece(src, dst, coalesce_page_runs([9, 3, 7, 1, 5, 11], list(range(1, 7))), range(NUM_LAYERS))
    both_scattered = KVPiece(src, dst, coalesce_page_runs([9, 3, 7, 1], [8, 2, 6, 4]), range(NUM_LAYERS))
    head_slice = KVPiece(src, KVRegion(1 << 30, layout(torch.bfloat16, heads=2)), scattered.runs, range(NUM_LAYERS),
                         head_slices(HEADS, 1, 0, 2, 1))
    assert not saves_spans(contiguous) and saves_spans(scattered)
    assert not saves_spans(both_scattered) and not saves_spans(head_slice)


def test_spans_that_continue_each_other_on_both_sides_merge():
    spans = ([100, 164, 300, 400], [1000, 1064, 2000, 2200], [64, 36, 100, 50])  # the last: a gap on one side
    assert merged(spans) == ([100, 300, 400], [1000, 2000, 2200], [100, 100, 50])
