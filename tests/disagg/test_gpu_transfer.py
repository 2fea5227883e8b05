"""GPU0 -> GPU1 transfers between two processes, exact bytes for scattered page runs. Needs 2 GPUs."""

from __future__ import annotations

import pytest
import torch

from transfer_peer import start_peer, stop_peer
from pdserve.disagg.transfer import KVRegion, TransferError, coalesce_page_runs, kv_write_requests
from pdserve.disagg.transfer import make_transfer_engine
from pdserve.mem_cache.kv_pool import KVLayout, KVPool

pytestmark = pytest.mark.gpu

SRC_LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, num_pages=64, dtype=torch.bfloat16)
DST_LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, num_pages=80, dtype=torch.bfloat16)


def _gpu_backends():
    out = ["nccl", "tcp"]
    try:
        import mooncake.engine as mc

        if mc.SUPPORT_CUDA:
            out.append("mooncake")
    except (ImportError, OSError):
        pass
    return out


@pytest.mark.parametrize("backend", _gpu_backends())
def test_gpu_scattered_pages(backend):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    torch.cuda.set_device(0)
    proc, conn, hello = start_peer(backend, "cuda:1", DST_LAYOUT)
    sender = make_transfer_engine(backend, "cuda:0", timeout_s=30)
    try:
        src = KVPool(SRC_LAYOUT, "cuda:0")
        src.buffer.view(torch.uint8).random_(0, 256)
        sender.register(src.data_ptr, src.nbytes, "cuda:0")
        gen = torch.Generator().manual_seed(0)
        src_pages = (torch.randperm(SRC_LAYOUT.num_pages - 1, generator=gen)[:40] + 1).tolist()
        dst_pages = (torch.randperm(DST_LAYOUT.num_pages - 1, generator=gen)[:40] + 1).tolist()
        src_pages[10:20] = range(30, 40)  # one long run on both sides
        dst_pages[10:20] = range(50, 60)
        runs = coalesce_page_runs(src_pages, dst_pages)
        sender.write(hello["session"], *kv_write_requests(KVRegion(src.data_ptr, SRC_LAYOUT),
                                                          KVRegion(hello["base"], DST_LAYOUT), runs))
        conn.send("dump")
        got = torch.frombuffer(bytearray(conn.recv()), dtype=torch.uint8).view(
            2, DST_LAYOUT.num_layers, DST_LAYOUT.num_slots, -1)
        want = torch.zeros_like(got)
        src_host = src.buffer.view(torch.uint8).cpu().view(2, SRC_LAYOUT.num_layers, SRC_LAYOUT.num_slots, -1)
        ps = SRC_LAYOUT.page_size
        for s, d in zip(src_pages, dst_pages):
            want[:, :, d * ps : (d + 1) * ps] = src_host[:, :, s * ps : (s + 1) * ps]
        assert torch.equal(got, want)
        with pytest.raises(TransferError):
            sender.write(hello["session"], [src.data_ptr], [hello["base"] + DST_LAYOUT.num_slots * 10**6], [64])
    finally:
        sender.close()
        stop_peer(proc, conn)
