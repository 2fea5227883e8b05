"""The nccl backend refuses a prefill and a decode on one physical GPU at its handshake, before any NCCL call: NCCL
cannot init a communicator with two ranks on one device (the 502 of PD TP 2 -> TP 2 sharing two GPUs, 2026-11-28).
On the CPU, with fake GPU UUIDs and a fake libnccl: the engines' control messages are real."""

from __future__ import annotations

import pytest
import torch

from pdserve.disagg.transfer import nccl
from pdserve.disagg.transfer.base import TransferError
from pdserve.disagg.transfer.nccl import NcclTransferEngine, check_distinct_gpus

FIX = "Use --disaggregation-transfer-backend mooncake, or put the prefill and the decode on different GPUs"


class FakeNccl:
    """Records the NCCL calls an engine makes; a refused handshake makes none."""

    path, version = "fake-libnccl", 0

    def __init__(self) -> None:
        self.calls: list[str] = []

    def unique_id(self) -> bytes:
        self.calls.append("unique_id")
        return bytes(nccl.NCCL_UNIQUE_ID_BYTES)

    def comm_init_rank(self, nranks: int, uid: bytes, rank: int) -> int:
        self.calls.append(f"comm_init_rank {rank}")
        return 1

    def abort(self, comm: int) -> None:
        self.calls.append("abort")


class FakeStream:
    def __init__(self, device) -> None:
        self.cuda_stream = 0


@pytest.fixture
def engines(monkeypatch):
    """Makes nccl engines on fake devices: cuda:0 and cuda:1 are two GPUs, cuda:7 is cuda:0's GPU seen by a process
    with another CUDA_VISIBLE_DEVICES."""
    uuids = {0: "GPU-aaaa", 1: "GPU-bbbb", 7: "GPU-aaaa"}
    monkeypatch.setattr(nccl, "gpu_uuid", lambda device: uuids[device.index])
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    made = []

    def make(device: str) -> tuple[NcclTransferEngine, FakeNccl]:
        library = FakeNccl()
        engine = NcclTransferEngine(device, timeout_s=10, library=library)
        made.append(engine)
        return engine, library

    yield make
    for engine in made:
        engine.close()


def test_distinct_gpus_pass_and_the_same_gpu_is_refused_naming_the_fix():
    check_distinct_gpus("GPU-aaaa", "GPU-bbbb", torch.device("cuda", 0))
    with pytest.raises(TransferError, match=r"same GPU \(cuda:1 here, UUID GPU-aaaa\)") as refused:
        check_distinct_gpus("GPU-aaaa", "GPU-aaaa", torch.device("cuda", 1))
    assert FIX in str(refused.value)


@pytest.mark.parametrize("sender_gpu", [None, "", 7, b"GPU-aaaa"])
def test_an_init_without_the_senders_gpu_is_refused(sender_gpu):
    with pytest.raises(TransferError, match="without the sender's GPU UUID"):
        check_distinct_gpus("GPU-aaaa", sender_gpu, torch.device("cuda", 0))


@pytest.mark.parametrize("receiver_device", ["cuda:0", "cuda:7"])
def test_a_sender_on_the_receivers_gpu_fails_at_the_handshake_before_any_nccl_call(engines, receiver_device):
    """cuda:7 is the same physical GPU under another index: the UUID decides, not the index."""
    sender, sender_nccl = engines("cuda:0")
    receiver, receiver_nccl = engines(receiver_device)
    with pytest.raises(TransferError) as refused:
        sender.connect(receiver.session_id())
    message = str(refused.value)
    assert f"{receiver.session_id()} refused the nccl init reply" in message
    assert "cannot link a prefill and a decode on the same GPU" in message and FIX in message
    assert sender_nccl.calls == ["unique_id"]  # no ncclCommInitRank: it would fail ("Duplicate GPU detected")
    assert receiver_nccl.calls == [] and not receiver._recv_comms  # no join thread waits for a sender that won't come
    assert not sender._send_comms
    with pytest.raises(TransferError, match="same GPU"):  # every later request is refused the same way, at once
        sender.connect(receiver.session_id())


def test_the_refusal_fails_the_request_with_a_502_naming_the_fix_and_frees_both_pools(tiny_model, monkeypatch):
    """Both halves of the request end with the refusal's words (the client's JSON error, whichever half answers it),
    and no page stays held. A tcp pair in one process whose prefill engine refuses as the nccl one does."""
    from test_pd_schedulers import make_pair, pd_req, run

    from pdserve.disagg.handoff import PEER_FAILED

    prefill, decode, port = make_pair(tiny_model)
    try:
        def refused_write(peer_session, *spans):
            check_distinct_gpus("GPU-aaaa", "GPU-aaaa", torch.device("cuda", 0))

        monkeypatch.setattr(prefill.role.link.engine, "write", refused_write)
        for s in (prefill, decode):
            s.add_request(pd_req("same-gpu", list(range(20, 60)), port, room=901))
        outs = run([prefill, decode])
        for half in (0, 1):
            finish = outs[(half, "same-gpu")]["finish"]
            assert finish["type"] == "abort" and finish["status_code"] == PEER_FAILED, finish
            assert "same GPU" in finish["message"] and "--disaggregation-transfer-backend mooncake" in finish["message"]
        assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()
    finally:
        prefill.close()
        decode.close()
