"""Real two-process transfers over loopback into a CPU KV buffer: exact bytes for scattered page runs."""

from __future__ import annotations

import pytest
import torch

from transfer_peer import start_peer, stop_peer
from pdserve.disagg.transfer import (
    HeadSlice,
    KVRegion,
    TransferError,
    coalesce_page_runs,
    kv_write_requests,
    make_transfer_engine,
)
from pdserve.disagg.transfer.mooncake import MAX_SPANS_PER_BATCH
from pdserve.mem_cache.kv_pool import KVLayout, KVPool

SRC_LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, num_pages=96, dtype=torch.float16)
DST_LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, num_pages=100, dtype=torch.float16)
SRC_PAGES = [3, 4, 5, 9, 2, 10, 11, 15]
DST_PAGES = [7, 8, 9, 1, 20, 21, 22, 23]


def _backends():
    out = ["tcp"]
    try:
        import mooncake.engine  # noqa: F401

        out.append("mooncake")
    except (ImportError, OSError):
        pass
    return out


@pytest.fixture(params=_backends())
def pair(request, monkeypatch):
    monkeypatch.setenv("MC_FORCE_TCP", "1")  # spawn children inherit it: Mooncake's TCP transport both ways
    proc, conn, hello = start_peer(request.param, "cpu", DST_LAYOUT)
    sender = make_transfer_engine(request.param, "cpu", timeout_s=10)
    src = KVPool(SRC_LAYOUT, "cpu")
    src.buffer.view(torch.uint8).copy_(torch.randint(0, 256, src.buffer.view(torch.uint8).shape, dtype=torch.uint8))
    sender.register(src.data_ptr, src.nbytes, "cpu")
    try:
        yield sender, src, hello, conn
    finally:
        sender.close()
        stop_peer(proc, conn)


def _remote_pool(conn) -> torch.Tensor:
    conn.send("dump")
    raw = conn.recv()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(DST_LAYOUT.dtype).view(
        2, DST_LAYOUT.num_layers, DST_LAYOUT.num_slots, DST_LAYOUT.num_kv_heads, DST_LAYOUT.head_dim
    )


def _expected(src: KVPool, src_pages, dst_pages) -> torch.Tensor:
    out = KVPool(DST_LAYOUT, "cpu").buffer
    ps = SRC_LAYOUT.page_size
    for s, d in zip(src_pages, dst_pages):
        out[:, :, d * ps : (d + 1) * ps] = src.buffer[:, :, s * ps : (s + 1) * ps]
    return out


def test_scattered_page_runs_land_exactly(pair):
    sender, src, hello, conn = pair
    assert hello["transport"] == "tcp"
    runs = coalesce_page_runs(SRC_PAGES, DST_PAGES)
    assert runs == [(3, 7, 3), (9, 1, 1), (2, 20, 1), (10, 21, 2), (15, 23, 1)]
    batch = kv_write_requests(KVRegion(src.data_ptr, SRC_LAYOUT), KVRegion(hello["base"], DST_LAYOUT), runs)
    sender.write(hello["session"], *batch)
    got = _remote_pool(conn)
    assert torch.equal(got.view(torch.uint8), _expected(src, SRC_PAGES, DST_PAGES).view(torch.uint8))
    # a second transfer to other pages adds to, and does not disturb, the first
    more_src, more_dst = [6, 7], [12, 3]
    batch = kv_write_requests(
        KVRegion(src.data_ptr, SRC_LAYOUT), KVRegion(hello["base"], DST_LAYOUT), coalesce_page_runs(more_src, more_dst)
    )
    sender.write(hello["session"], *batch)
    got = _remote_pool(conn)
    want = _expected(src, SRC_PAGES + more_src, DST_PAGES + more_dst)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_receiver_refuses_span_outside_its_regions_then_recovers(pair):
    sender, src, hello, conn = pair
    nbytes = KVPool(DST_LAYOUT, "meta").nbytes
    with pytest.raises(TransferError):
        sender.write(hello["session"], [src.data_ptr], [hello["base"] + nbytes - 8], [16])
    with pytest.raises(TransferError):
        sender.write(hello["session"], [src.data_ptr], [hello["base"] - 16], [16])
    assert not any(_remote_pool(conn).view(torch.uint8).flatten().tolist())
    sender.write(hello["session"], [src.data_ptr + 64], [hello["base"] + 128], [32])
    got = _remote_pool(conn).view(torch.uint8).flatten()
    assert torch.equal(got[128:160], src.buffer.view(torch.uint8).flatten()[64:96])
    assert got[:128].sum() == 0 and got[160:].sum() == 0


def test_sender_refuses_unregistered_source(pair):
    sender, src, hello, conn = pair
    with pytest.raises(TransferError, match="outside every registered region"):
        sender.write(hello["session"], [src.data_ptr + src.nbytes - 4], [hello["base"]], [8])


def test_tcp_write_to_silent_peer_times_out():
    sender = make_transfer_engine("tcp", "cpu", timeout_s=0.5)
    buf = torch.zeros(64, dtype=torch.uint8)
    sender.register(buf.data_ptr(), 64)
    try:
        with pytest.raises(TransferError, match="no write ack from 127.0.0.1:9 within"):
            sender.write("127.0.0.1:9", [buf.data_ptr()], [4096], [64])
    finally:
        sender.close()


def test_tcp_receiver_refuses_malformed_messages():
    from pdserve.disagg.control_transport import ControlClient

    receiver = make_transfer_engine("tcp", "cpu")
    buf = torch.zeros(64, dtype=torch.uint8)
    receiver.register(buf.data_ptr(), 64)
    client = ControlClient(receiver.session_id(), timeout_s=5)
    try:
        ptr = buf.data_ptr()
        bad = [
            ({"op": "write", "dst": [[ptr, "8", 1, 0]]}, [b"x" * 8], "malformed span"),
            ({"op": "write", "dst": [[ptr, 8]]}, [b"x" * 8], "malformed span"),
            ({"op": "write", "dst": [[ptr, 8, 1, 0]]}, [b"x" * 7], "declares 8 bytes but carries 7"),
            ({"op": "write", "dst": [[ptr, 8, 2, 4]]}, [b"x" * 16], "spans must not overlap"),
            ({"op": "write", "dst": [[ptr, 8, 0, 8]]}, [b""], "count must be positive"),
            ({"op": "write", "dst": [[ptr, 8, 4, 32]]}, [b"x" * 32], "outside every registered region"),  # 104 B
            ({"op": "write", "dst": [[ptr, 8, 1, 0]]}, [], "1 blocks but 0 payload frames"),
            ({"op": "read", "dst": []}, [], "unknown op"),
        ]
        for header, payload, message in bad:
            client.send(header, payload)
            with pytest.raises(TransferError, match=message):
                client.recv("ack")
        assert not buf.any()
        client.send({"op": "write", "dst": [[ptr + 4, 2, 3, 16]]}, [bytes(range(1, 7))])  # every 16 bytes, 2 of them
        client.recv("ack")
        assert buf.tolist()[:40] == [0] * 4 + [1, 2] + [0] * 14 + [3, 4] + [0] * 14 + [5, 6] + [0] * 2
    finally:
        client.close()
        receiver.close()


def test_a_head_slice_lands_token_by_token_in_one_write_of_thousands_of_spans(pair):
    """Source head 1 into destination head 0 (what one prefill rank of TP 2 writes into a TP 1 decode, were the
    pools' head counts those): one span per token, leaving the other head untouched; more spans than one mooncake
    call takes still land as one write."""
    sender, src, hello, conn = pair
    pages = list(range(1, SRC_LAYOUT.num_pages))
    spans = kv_write_requests(KVRegion(src.data_ptr, SRC_LAYOUT), KVRegion(hello["base"], DST_LAYOUT),
                              coalesce_page_runs(pages, pages), heads=[HeadSlice(1, 0, 1)])
    assert len(spans[2]) == 2 * SRC_LAYOUT.num_layers * len(pages) * SRC_LAYOUT.page_size > MAX_SPANS_PER_BATCH
    sender.write(hello["session"], *spans)
    want = KVPool(DST_LAYOUT, "cpu").buffer
    slots = slice(SRC_LAYOUT.page_size, SRC_LAYOUT.num_slots)
    want[:, :, slots, 0] = src.buffer[:, :, slots, 1]
    assert torch.equal(_remote_pool(conn).view(torch.uint8), want.view(torch.uint8))


def test_destination_spans_that_overlap_are_refused_before_any_byte_moves(pair):
    """Two source pages into one destination page: a backend copying a batch's spans at once (mooncake) would leave
    either page's bytes there, so no backend takes such a batch."""
    sender, src, hello, conn = pair
    runs = coalesce_page_runs([3, 9], [7, 7])
    batch = kv_write_requests(KVRegion(src.data_ptr, SRC_LAYOUT), KVRegion(hello["base"], DST_LAYOUT), runs)
    with pytest.raises(TransferError, match="destination spans overlap"):
        sender.write(hello["session"], *batch)
    assert not _remote_pool(conn).view(torch.uint8).any()
