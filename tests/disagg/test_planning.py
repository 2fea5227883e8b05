"""Pure-Python parts of the transfer layer: run planning, bounds checks, backend selection, NCCL binding."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pdserve.disagg.head_map import head_slices, rank_heads
from pdserve.disagg.transfer import HeadSlice, KVRegion, TransferError, coalesce_page_runs, kv_write_requests
from pdserve.disagg.transfer import layout_from_description, make_transfer_engine
from pdserve.disagg.transfer.base import RegionTable
from pdserve.disagg.transfer.strided import StridedBlock, strided_blocks
from pdserve.disagg.transfer.mooncake import select_transport
from pdserve.disagg.transfer.nccl import (
    NCCL_UNIQUE_ID_BYTES,
    nccl_library_candidates,
    load_nccl,
    plan_groups,
    unique_id_from_bytes,
)
from pdserve.mem_cache.kv_pool import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=8, num_pages=10, dtype=torch.bfloat16)


def test_coalesce_merges_only_when_both_sides_advance():
    assert coalesce_page_runs([], []) == []
    assert coalesce_page_runs([1, 2, 3, 7, 8, 4], [5, 6, 7, 9, 1, 2]) == [(1, 5, 3), (7, 9, 1), (8, 1, 1), (4, 2, 1)]
    assert coalesce_page_runs([3, 2, 1], [1, 2, 3]) == [(3, 1, 1), (2, 2, 1), (1, 3, 1)]
    with pytest.raises(TransferError, match="3 source pages but 2"):
        coalesce_page_runs([1, 2, 3], [1, 2])


def test_kv_write_requests_covers_every_layer_k_and_v():
    dst_layout = KVLayout(2, 2, 4, 8, 20, torch.bfloat16)
    src, dst = KVRegion(1000, LAYOUT), KVRegion(50_000, dst_layout)
    srcs, dsts, lens = kv_write_requests(src, dst, [(2, 5, 3), (9, 19, 1)])
    pb = LAYOUT.page_bytes
    assert pb == 8 * 2 * 4 * 2 and len(srcs) == 2 * 2 * 2
    expected = []
    for kv in (0, 1):
        for layer in (0, 1):
            for s, d, n in [(2, 5, 3), (9, 19, 1)]:
                expected.append((1000 + LAYOUT.region_offset(kv, layer) + s * pb,
                                 50_000 + dst_layout.region_offset(kv, layer) + d * pb, n * pb))
    assert list(zip(srcs, dsts, lens)) == expected


@pytest.mark.parametrize("run", [(0, 1, 1), (1, 0, 1), (9, 1, 2), (1, 19, 2), (1, 1, 0), (-1, 1, 1), (1, 1, True), (1.0, 1, 1)])
def test_kv_write_requests_refuses_out_of_range(run):
    with pytest.raises(TransferError):
        kv_write_requests(KVRegion(1000, LAYOUT), KVRegion(9000, KVLayout(2, 2, 4, 8, 20, torch.bfloat16)), [run])


def test_kv_write_requests_refuses_different_page_geometry():
    other = KVLayout(2, 2, 4, 16, 10, torch.bfloat16)
    with pytest.raises(TransferError, match="layouts differ"):
        kv_write_requests(KVRegion(1000, LAYOUT), KVRegion(9000, other), [(1, 1, 1)])


def test_layout_round_trip_and_validation():
    assert layout_from_description(LAYOUT.describe()) == LAYOUT
    for bad in ({**LAYOUT.describe(), "page_size": 0}, {**LAYOUT.describe(), "num_layers": "2"},
                {**LAYOUT.describe(), "dtype": "object"}, {k: v for k, v in LAYOUT.describe().items() if k != "head_dim"},
                [1, 2]):
        with pytest.raises(TransferError):
            layout_from_description(bad)


def test_region_table_bounds():
    table = RegionTable()
    table.add(1000, 100, "cpu")
    table.add(2000, 50, "cpu")
    assert table.find(1000, 100).ptr == 1000
    assert table.find(2049, 1).ptr == 2000
    for ptr, n in [(999, 2), (1050, 51), (1100, 1), (2000, 51), (10, 1), (1000, 0), (1000, -5)]:
        with pytest.raises(TransferError):
            table.find(ptr, n)
    with pytest.raises(TransferError, match="overlaps"):
        table.add(1099, 10, "cpu")
    with pytest.raises(TransferError, match="overlaps"):
        table.add(1990, 20, "cpu")


def test_fake_engine_moves_nothing_but_checks_sources():
    engine = make_transfer_engine("fake", "cpu")
    buf = torch.ones(64, dtype=torch.uint8)
    engine.register(buf.data_ptr(), 64)
    engine.write("anyone:1", [buf.data_ptr()], [12345], [64])
    with pytest.raises(TransferError):
        engine.write("anyone:1", [buf.data_ptr() + 1], [12345], [64])
    with pytest.raises(TransferError, match="differ in length"):
        engine.write("anyone:1", [buf.data_ptr()], [], [64])
    assert engine.transport() == "fake" and bool(buf.all())


def test_unknown_backend():
    with pytest.raises(TransferError, match="unknown transfer backend"):
        make_transfer_engine("carrier-pigeon", "cpu")


# --- mooncake transport selection ---


def test_mooncake_selection_order():
    pick = select_transport
    assert pick("cuda:0", None, True, [], {}).transport == "nvlink_intra"
    assert pick("cuda:0", None, True, [], {}).env == {"MC_INTRANODE_NVLINK": "1"}
    assert pick("cuda:0", None, False, [], {}).env == {"MC_FORCE_TCP": "1"}
    assert pick("cpu", None, True, [], {}).transport == "tcp"
    assert pick("cuda:0", None, True, ["mlx5_0"], {}).transport == "rdma"
    choice = pick("cuda:0", "mlx5_1", True, ["mlx5_0", "mlx5_1"], {})
    assert (choice.transport, choice.device_name, choice.env) == ("rdma", "mlx5_1", {})
    user = pick("cuda:0", None, True, ["mlx5_0"], {"MC_FORCE_TCP": "0"})  # presence-tested, like Mooncake
    assert (user.transport, user.env) == ("tcp", {})
    assert pick("cuda:0", None, False, [], {"MC_INTRANODE_NVLINK": "1"}).transport == "nvlink_intra"


def test_mooncake_unknown_ib_device_lists_present_ones():
    with pytest.raises(TransferError, match="no RDMA device named mlx5_9; present: mlx5_0, mlx5_1"):
        select_transport("cuda:0", "mlx5_0,mlx5_9", True, ["mlx5_0", "mlx5_1"], {})
    with pytest.raises(TransferError, match="present: none"):
        select_transport("cpu", "mlx5_0", False, [], {})


# --- nccl binding, without a GPU ---


def test_nccl_library_candidates(tmp_path):
    (tmp_path / "nccl" / "lib").mkdir(parents=True)
    (tmp_path / "nccl" / "lib" / "libnccl.so.2").write_bytes(b"")
    (tmp_path / "cu13" / "lib").mkdir(parents=True)
    (tmp_path / "cu13" / "lib" / "libnccl.so.2").write_bytes(b"")
    found = nccl_library_candidates({"PDSERVE_NCCL_LIBRARY": "/opt/x/libnccl.so"}, [str(tmp_path)])
    assert found == ["/opt/x/libnccl.so", str(tmp_path / "nccl/lib/libnccl.so.2"),
                     str(tmp_path / "cu13/lib/libnccl.so.2"), "libnccl.so.2"]
    with pytest.raises(TransferError, match="libnccl not found.*nccl/lib/libnccl.so.2"):
        load_nccl(found[1:2])


def test_nccl_unique_id_marshalling():
    raw = bytes(range(NCCL_UNIQUE_ID_BYTES))
    uid = unique_id_from_bytes(raw)
    assert ctypes.sizeof(uid) == 128 and ctypes.string_at(ctypes.addressof(uid), 128) == raw
    for bad in (raw[:-1], raw + b"x", "x" * 128, None):
        with pytest.raises(TransferError, match="128 bytes"):
            unique_id_from_bytes(bad)


def test_nccl_group_plan():
    spans = [(i * 10, 10) for i in range(2500)]
    groups = plan_groups(spans, max_ops=1024)
    assert [len(g) for g in groups] == [1024, 1024, 452]
    assert [s for g in groups for s in g] == spans
    assert plan_groups([], 4) == []


@pytest.mark.parametrize("num_kv_heads, prefill_tp, decode_tp",
                         [(2, 2, 1), (2, 1, 2), (2, 2, 2), (1, 2, 1), (1, 1, 2), (1, 2, 2), (4, 2, 4), (2, 4, 1)])
def test_head_slices_fill_every_decode_rank_from_the_prefill_ranks_exactly_once(num_kv_heads, prefill_tp, decode_tp):
    """Each prefill rank's spans, executed byte by byte, leave every decode rank with its heads of the moved pages;
    a replicated head is sent once per decode rank, so the bytes written equal the bytes each decode rank holds."""
    layers, head_dim, page_size, src_pages, dst_pages = 2, 4, 2, [1, 2, 4], [5, 3, 4]
    full = torch.randn(2, layers, 6 * page_size, num_kv_heads, head_dim)  # the model's KV at the prefill: 6 pages

    def pool(tp: int, rank: int, num_pages: int, source: torch.Tensor | None) -> tuple[KVRegion, torch.Tensor]:
        heads = rank_heads(num_kv_heads, tp, rank)
        layout = KVLayout(layers, len(heads), head_dim, page_size, num_pages, torch.float32)
        data = source[:, :, :, heads.start:heads.stop].contiguous() if source is not None else \
            torch.full((2, layers, num_pages * page_size, len(heads), head_dim), float("nan"))
        return KVRegion(0, layout), data  # base 0: the spans are byte offsets into `data`

    decode = [pool(decode_tp, j, 8, None) for j in range(decode_tp)]
    runs = coalesce_page_runs(src_pages, dst_pages)
    for i in range(prefill_tp):
        src_region, src_data = pool(prefill_tp, i, 6, full)
        src_bytes = src_data.view(-1).view(torch.uint8)
        for j, (dst_region, dst_data) in enumerate(decode):
            slices = head_slices(num_kv_heads, prefill_tp, i, decode_tp, j)
            if not slices:
                continue
            dst_bytes = dst_data.view(-1).view(torch.uint8)
            for s, d, n in zip(*kv_write_requests(src_region, dst_region, runs, heads=slices)):
                assert dst_bytes[d : d + n].view(torch.float32).isnan().all()  # no byte is written twice
                dst_bytes[d : d + n] = src_bytes[s : s + n]
    for j, (_, dst_data) in enumerate(decode):
        heads = rank_heads(num_kv_heads, decode_tp, j)
        for src_page, dst_page in zip(src_pages, dst_pages):
            got = dst_data[:, :, dst_page * page_size : (dst_page + 1) * page_size]
            assert torch.equal(got, full[:, :, src_page * page_size : (src_page + 1) * page_size,
                                         heads.start:heads.stop])


def test_a_head_slice_within_tokens_is_one_span_per_token_and_whole_tokens_one_per_run():
    two_heads, one_head = LAYOUT, KVLayout(2, 1, 4, 8, 10, torch.bfloat16)
    whole = kv_write_requests(KVRegion(1000, one_head), KVRegion(9000, one_head), [(1, 2, 3)],
                              heads=[HeadSlice(0, 0, 1)])
    assert whole[2] == [3 * one_head.page_bytes] * 4  # K and V of 2 layers: one span each
    into_second_head = kv_write_requests(KVRegion(1000, one_head), KVRegion(9000, two_heads), [(1, 2, 3)],
                                         heads=[HeadSlice(0, 1, 1)])
    assert len(into_second_head[2]) == 4 * 3 * 8 and set(into_second_head[2]) == {4 * 2}
    assert into_second_head[1][:2] == [9000 + 2 * two_heads.page_bytes + 8, 9000 + 2 * two_heads.page_bytes + 8 + 16]
    with pytest.raises(TransferError, match="out of range"):
        kv_write_requests(KVRegion(1000, one_head), KVRegion(9000, two_heads), [(1, 2, 3)], heads=[HeadSlice(0, 1, 2)])
    with pytest.raises(TransferError, match="say which heads go where"):
        kv_write_requests(KVRegion(1000, one_head), KVRegion(9000, two_heads), [(1, 2, 3)])


def test_spans_repeating_at_a_stride_fold_into_blocks():
    fold = strided_blocks
    assert fold([], [], [], 64) == []
    # 3 tokens of a head slice (stride 16 here, 32 there), then a span of another length, then 2 that overlap
    src, dst, lengths = [100, 116, 132, 500, 900, 904], [0, 32, 64, 300, 700, 704], [8, 8, 8, 4, 8, 8]
    assert fold(src, dst, lengths, 64) == [StridedBlock(100, 0, 8, 3, 16, 32), StridedBlock(500, 300, 4),
                                           StridedBlock(900, 700, 8), StridedBlock(904, 704, 8)]
    assert fold(src, dst, lengths, 8) == [StridedBlock(p, q, n) for p, q, n in zip(src, dst, lengths)]  # too long
    # the stride changes: a new block starts with the span where it changed
    assert fold([0, 10, 20, 40, 60], [0, 10, 20, 40, 60], [5] * 5, 64) == [StridedBlock(0, 0, 5, 3, 10, 10),
                                                                         StridedBlock(40, 40, 5, 2, 20, 20)]
    spans = kv_write_requests(KVRegion(1000, KVLayout(2, 1, 4, 8, 10, torch.bfloat16)), KVRegion(9000, LAYOUT),
                              [(1, 2, 3)], heads=[HeadSlice(0, 1, 1)])
    assert len(fold(*spans, 64)) == 4 and sum(b.nbytes for b in fold(*spans, 64)) == sum(spans[2])
