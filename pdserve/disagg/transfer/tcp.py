"""Host-staged transfer over ZeroMQ: works everywhere, host or CUDA memory, at socket speed.

A write is one multipart message: a msgpack header {"op": "write", "dst": [[ptr, len], ...]} and one
payload frame per span. The receiver thread checks every destination span against its registered
regions, copies the frames into place (memoryview copy for host memory, one H2D copy plus device-side
scatter for CUDA memory), synchronizes, then acks. The writer blocks until the ack or the timeout.
With a cluster secret the header is signed (see channel.py): an unsigned write is refused before any byte
is copied.
"""

from __future__ import annotations

import threading

import torch
import zmq

from pdserve.disagg.auth import ClusterAuth
from pdserve.disagg.transfer.base import (
    MemoryRegion,
    TransferEngine,
    TransferError,
    check_batch,
    host_view,
    region_tensor,
)
from pdserve.disagg.transfer.channel import ControlServer, PeerClients, parse_spans


class TcpTransferEngine(TransferEngine):
    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0,
                 auth: ClusterAuth | None = None):
        super().__init__()
        self._lock = threading.Lock()  # guards the region-tensor cache shared by both threads
        self._region_tensors: dict[int, torch.Tensor] = {}
        self._peers = PeerClients(timeout_s, auth)
        self._server = ControlServer(host, port, self._handle, "tcp", auth)
        self._closed = False

    def session_id(self) -> str:
        return self._server.endpoint

    def transport(self) -> str:
        return "tcp"

    def connect(self, peer_session: str) -> None:
        self._peers.get(peer_session)

    def write(self, peer_session: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]) -> None:
        check_batch(src_ptrs, dst_ptrs, lengths)
        if not lengths:
            return
        payload = self._read_local(src_ptrs, lengths)
        client = self._peers.get(peer_session)
        try:
            client.send({"op": "write", "dst": [[d, n] for d, n in zip(dst_ptrs, lengths)]}, payload, copy=False)
            client.recv("write ack")
        except TransferError:
            self._peers.drop(peer_session)
            raise

    def _read_local(self, ptrs: list[int], lengths: list[int]) -> list[memoryview]:
        """One buffer per span: zero-copy views for host memory, one batched D2H copy for CUDA spans."""
        regions = [self.regions.find(p, n) for p, n in zip(ptrs, lengths)]
        out: list[memoryview | None] = [None] * len(ptrs)
        cuda_spans: list[int] = []
        for i, (region, ptr, n) in enumerate(zip(regions, ptrs, lengths)):
            if region.is_cuda:
                cuda_spans.append(i)
            else:
                out[i] = host_view(ptr, n)
        if cuda_spans:
            pieces = [self._tensor(regions[i])[ptrs[i] - regions[i].ptr :][: lengths[i]] for i in cuda_spans]
            staged = torch.cat(pieces).cpu()  # synchronous: the bytes are on the host afterwards
            view = memoryview(staged.numpy())
            offset = 0
            for i in cuda_spans:
                out[i] = view[offset : offset + lengths[i]]
                offset += lengths[i]
        return out

    def _handle(self, header: dict, frames: list[zmq.Frame], reply) -> None:
        if header.get("op") != "write":
            raise TransferError(f"unknown op {header.get('op')!r}")
        spans = parse_spans(header)
        if len(frames) != len(spans):
            raise TransferError(f"{len(spans)} spans but {len(frames)} payload frames")
        targets = []
        for (ptr, n), frame in zip(spans, frames):
            if frame.buffer.nbytes != n:
                raise TransferError(f"span at {ptr:#x} declares {n} bytes but carries {frame.buffer.nbytes}")
            targets.append((self.regions.find(ptr, n), ptr, n, frame.buffer))
        self._write_local(targets)
        reply({"ok": True})

    def _write_local(self, targets: list[tuple[MemoryRegion, int, int, memoryview]]) -> None:
        cuda_targets = []
        for region, ptr, n, data in targets:
            if region.is_cuda:
                cuda_targets.append((region, ptr, n, data))
            else:
                host_view(ptr, n)[:] = data
        if not cuda_targets:
            return
        total = sum(n for _, _, n, _ in cuda_targets)
        staged = torch.empty(total, dtype=torch.uint8)
        view = memoryview(staged.numpy())
        offset = 0
        for _, _, n, data in cuda_targets:
            view[offset : offset + n] = data
            offset += n
        devices = {region.device for region, *_ in cuda_targets}
        on_device = {device: staged.to(device) for device in devices}
        offset = 0
        for region, ptr, n, _ in cuda_targets:
            self._tensor(region)[ptr - region.ptr :][:n].copy_(on_device[region.device][offset : offset + n])
            offset += n
        for device in devices:
            torch.cuda.synchronize(device)

    def _tensor(self, region: MemoryRegion) -> torch.Tensor:
        with self._lock:
            t = self._region_tensors.get(region.ptr)
            if t is None:
                t = self._region_tensors[region.ptr] = region_tensor(region)
            return t

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.close()
        self._peers.close()
        self._region_tensors.clear()
