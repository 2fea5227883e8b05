"""GPU0 -> GPU1 transfers between two processes: the exact bytes over every path a PD server can take (mooncake over
nvlink_intra and over its TCP transport, nccl, tcp), each packed and in place, whole pages and a head slice, and
into the decode's receive staging, unpacked there. Needs 2 GPUs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from transfer_peer import start_peer, stop_peer
from pdserve.disagg.kv_checksum import head_checksums
from pdserve.disagg.transfer import HeadSlice, KVRegion, TransferError, coalesce_page_runs, make_transfer_engine
from pdserve.disagg.transfer.base import StagedDestination
from pdserve.disagg.transfer.packing import KVMover, KVPiece
from pdserve.mem_cache.kv_pool import KVLayout, KVPool

pytestmark = pytest.mark.multi_gpu  # implies gpu; skipped below two GPUs (tests/conftest.py)

SRC_LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, num_pages=64, dtype=torch.bfloat16)
DST_LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, num_pages=80, dtype=torch.bfloat16)
PATHS = {  # path -> (backend, environment of both processes, the transport it must report)
    "nccl": ("nccl", {}, "nccl"),
    "tcp": ("tcp", {}, "tcp"),
    "mooncake": ("mooncake", {}, "nvlink_intra"),
    "mooncake-tcp": ("mooncake", {"MC_FORCE_TCP": "1"}, "tcp"),  # a build without intra-node NVLink, or the user's
}


def _paths():
    try:
        import mooncake.engine as mc

        cuda_mooncake = bool(mc.SUPPORT_CUDA)
    except (ImportError, OSError):
        cuda_mooncake = False
    return [p for p in PATHS if cuda_mooncake or PATHS[p][0] != "mooncake"]


def distinct_scattered_pages(n: int) -> tuple[list[int], list[int]]:
    """`n` distinct pages on each side, scattered at random, with one long run on both sides."""
    gen = torch.Generator().manual_seed(0)
    src = [p for p in (torch.randperm(SRC_LAYOUT.num_pages - 1, generator=gen) + 1).tolist() if not 30 <= p < 40]
    dst = [p for p in (torch.randperm(DST_LAYOUT.num_pages - 1, generator=gen) + 1).tolist() if not 50 <= p < 60]
    return src[:10] + list(range(30, 40)) + src[10 : n - 10], dst[:10] + list(range(50, 60)) + dst[10 : n - 10]


def received(conn, command: str | tuple = "dump") -> torch.Tensor:
    conn.send(command)
    return torch.frombuffer(bytearray(conn.recv()), dtype=torch.uint8).view(
        2, DST_LAYOUT.num_layers, DST_LAYOUT.num_slots, DST_LAYOUT.num_kv_heads, -1)


def expected(src_host: torch.Tensor, src_pages, dst_pages, src_heads=slice(None), dst_heads=slice(None)):
    want = torch.zeros(2, DST_LAYOUT.num_layers, DST_LAYOUT.num_slots, DST_LAYOUT.num_kv_heads,
                       DST_LAYOUT.head_dim * DST_LAYOUT.itemsize, dtype=torch.uint8)
    ps = SRC_LAYOUT.page_size
    for s, d in zip(src_pages, dst_pages):
        want[:, :, d * ps : (d + 1) * ps, dst_heads] = src_host[:, :, s * ps : (s + 1) * ps, src_heads]
    return want


def mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    """Which destination pages differ, and whether they hold zeros (never written) or other bytes."""
    per_page = (got != want).view(2, DST_LAYOUT.num_layers, DST_LAYOUT.num_pages, -1).any(-1).any(0).any(0)
    pages = per_page.nonzero().flatten().tolist()
    zeros = [p for p in pages if not got.view(2, DST_LAYOUT.num_layers, DST_LAYOUT.num_pages, -1)[:, :, p].any()]
    return f"{len(pages)} destination pages differ: {pages[:16]}; all-zero among them: {zeros[:16]}"


@pytest.mark.parametrize("path", _paths())
def test_gpu_scattered_pages(path, monkeypatch):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    backend, environment, transport = PATHS[path]
    for name, value in environment.items():
        monkeypatch.setenv(name, value)  # the spawned peer inherits it
    torch.cuda.set_device(0)
    proc, conn, hello = start_peer(backend, "cuda:1", DST_LAYOUT)
    sender = make_transfer_engine(backend, "cuda:0", timeout_s=30)
    try:
        assert (sender.transport(), hello["transport"]) == (transport, transport)
        src = KVPool(SRC_LAYOUT, "cuda:0")
        src.buffer.view(torch.uint8).random_(0, 256)
        torch.cuda.synchronize()
        sender.register(src.data_ptr, src.nbytes, "cuda:0")
        mover = KVMover(sender, "cuda:0", 1 << 20, timeout_s=30)  # small: packed writes split in several
        src_host = src.buffer.view(torch.uint8).cpu().view(2, SRC_LAYOUT.num_layers, SRC_LAYOUT.num_slots,
                                                          SRC_LAYOUT.num_kv_heads, -1)
        src_pages, dst_pages = distinct_scattered_pages(40)
        runs = coalesce_page_runs(src_pages, dst_pages)
        src_region, dst_region = KVRegion(src.data_ptr, SRC_LAYOUT), KVRegion(hello["base"], DST_LAYOUT)
        whole = KVPiece(src_region, dst_region, runs, range(SRC_LAYOUT.num_layers))
        head = KVPiece(src_region, dst_region, runs, range(SRC_LAYOUT.num_layers), [HeadSlice(1, 0, 1)])
        cases = [(whole, False, expected(src_host, src_pages, dst_pages)),
                 (whole, True, expected(src_host, src_pages, dst_pages)),
                 (head, False, expected(src_host, src_pages, dst_pages, slice(1, 2), slice(0, 1))),
                 (head, True, expected(src_host, src_pages, dst_pages, slice(1, 2), slice(0, 1))),
                 ("staged", True, expected(src_host, src_pages, dst_pages))]
        for room, (piece, pack, want) in enumerate(cases):
            received(conn, "zero")
            if piece == "staged":  # into the peer's receive staging, which it unpacks into the pages
                conn.send(("stage", room, len(dst_pages)))
                piece = replace(whole, staged=StagedDestination(conn.recv(), len(dst_pages)))
            mover.write(hello["session"], [piece], pack=pack)
            got = received(conn, ("unpack", room, dst_pages) if piece.staged else "dump")
            how = "staged" if piece.staged else "packed" if pack else "in place"
            what = f"{path} over {sender.transport()}, {how}, heads {piece.heads}"
            assert torch.equal(got, want), f"{what}: {mismatch(got, want)}"
            if piece is whole:  # the checksum a decode compares: the same on the sender's GPU and over what landed
                landed = KVPool(DST_LAYOUT, "cpu")
                landed.buffer.view(torch.uint8).copy_(got.view(landed.buffer.view(torch.uint8).shape))
                assert head_checksums(landed, dst_pages, 0) == head_checksums(src, src_pages, 0)
        assert mover.arena.bytes_in_use == 0
        with pytest.raises(TransferError):
            sender.write(hello["session"], [src.data_ptr], [hello["base"] + DST_LAYOUT.num_slots * 10**6], [64])
    finally:
        sender.close()
        stop_peer(proc, conn)
