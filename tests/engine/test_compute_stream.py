"""The scheduler's forwards run on a non-blocking stream of their own, so work on the legacy default stream (a
transfer engine's synchronous copies from the KV writer thread) never queues behind them."""

from __future__ import annotations

import threading

import pytest
import torch

from pdserve.engine.model_runner import use_compute_stream

pytestmark = pytest.mark.gpu


def test_a_legacy_stream_copy_does_not_wait_for_queued_forwards():
    device = torch.device("cuda", 0)
    previous = torch.cuda.current_stream(device)
    stream = use_compute_stream(device)
    try:
        assert torch.cuda.current_stream(device) == stream != torch.cuda.default_stream(device)
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        src, dst = torch.ones(1 << 20, device=device), torch.zeros(1 << 20, device=device)
        torch.cuda.synchronize(device)
        for _ in range(200):  # about a second of matmuls queued on the compute stream
            a = a @ a / 8192
        computed = torch.cuda.Event()
        computed.record()

        def copy_on_the_legacy_stream():  # what the writer thread does: its current stream is the default one
            with torch.cuda.stream(torch.cuda.default_stream(device)):
                dst.copy_(src)
                torch.cuda.default_stream(device).synchronize()

        writer = threading.Thread(target=copy_on_the_legacy_stream)
        writer.start()
        writer.join(timeout=30)
        assert not writer.is_alive()
        assert not computed.query(), "the copy waited for the forwards queued before it"
        assert torch.equal(dst, src)
        computed.synchronize()
    finally:
        torch.cuda.set_stream(previous)
