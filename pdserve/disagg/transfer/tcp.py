"""Host-staged transfer over ZeroMQ: works everywhere, host or CUDA memory, at socket speed.

A write is one multipart message: a msgpack header {"op": "write", "dst": [[ptr, length, count, stride], ...]}
and one payload frame per block of spans repeating at a fixed stride (a page run is one span, a head range of it
one span per token: see strided.py). The receiver thread checks every destination block against its registered
regions, copies the frames into place (a strided copy for host memory, one H2D copy plus device-side scatter for
CUDA memory), synchronizes, then acks. The writer blocks until the ack or the timeout.
With a cluster secret the header is signed (see control_transport.py): an unsigned write is refused before any byte
is copied.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
import zmq

from pdserve.cluster_auth import ClusterAuth
from pdserve.disagg.transfer.base import (
    MemoryRegion,
    TransferError,
    host_view,
    region_tensor,
)
from pdserve.disagg.transfer.channel_engine import ChannelEngine
from pdserve.disagg.transfer.strided import StridedBlock, block_to_wire, host_block, parse_blocks, strided_blocks


# Spans shorter than this that repeat at a stride travel as one block (one strided copy, one frame): a frame and
# a copy per span cost ~17 us each, 40x the bytes' time for a 1 KiB head slice of a token; longer spans go as
# their own zero-copy frames.
FOLD_BELOW_BYTES = 64 << 10


class TcpTransferEngine(ChannelEngine):
    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0,
                 auth: ClusterAuth | None = None):
        self._lock = threading.Lock()  # guards the region-tensor cache shared by both threads
        self._region_tensors: dict[int, torch.Tensor] = {}
        super().__init__(host, port, timeout_s, auth, self._handle)  # last: its server calls _handle at once

    def transport(self) -> str:
        return "tcp"

    def connect(self, peer_session: str) -> None:
        self._peers.get(peer_session)

    def write(self, peer_session: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]) -> None:
        if not self.has_spans_to_write(src_ptrs, dst_ptrs, lengths):
            return
        blocks = strided_blocks(src_ptrs, dst_ptrs, lengths, FOLD_BELOW_BYTES)
        payload = self._read_local(blocks)
        client = self._peers.get(peer_session)
        try:
            client.send({"op": "write", "dst": [block_to_wire(b) for b in blocks]}, payload, copy=False)
            client.recv("write ack")
        except TransferError:
            self._peers.drop(peer_session)
            raise

    def _read_local(self, blocks: list[StridedBlock]) -> list[memoryview]:
        """One buffer per block: a zero-copy view of a single host span, one strided copy of a host block, one
        batched D2H copy for the CUDA blocks."""
        regions = [self.regions.find(b.src, b.extent(b.src_stride)) for b in blocks]
        out: list[memoryview | None] = [None] * len(blocks)
        cuda_blocks: list[int] = []
        for i, (region, b) in enumerate(zip(regions, blocks)):
            if region.is_cuda:
                cuda_blocks.append(i)
            elif b.count == 1:
                out[i] = host_view(b.src, b.length)
            else:
                out[i] = memoryview(np.ascontiguousarray(host_block(b.src, b, b.src_stride, host_view)).reshape(-1))
        if cuda_blocks:
            pieces = [self._strided(regions[i], blocks[i].src, blocks[i], blocks[i].src_stride).reshape(-1)
                      for i in cuda_blocks]
            staged = torch.cat(pieces).cpu()  # synchronous: the bytes are on the host afterwards
            view = memoryview(staged.numpy())
            offset = 0
            for i in cuda_blocks:
                out[i] = view[offset : offset + blocks[i].nbytes]
                offset += blocks[i].nbytes
        return out

    def _handle(self, header: dict, frames: list[zmq.Frame], reply) -> None:
        if header.get("op") != "write":
            raise TransferError(f"unknown op {header.get('op')!r}")
        blocks = parse_blocks(header)
        if len(frames) != len(blocks):
            raise TransferError(f"{len(blocks)} blocks but {len(frames)} payload frames")
        targets = []
        for b, frame in zip(blocks, frames):
            if frame.buffer.nbytes != b.nbytes:
                raise TransferError(f"block at {b.dst:#x} declares {b.nbytes} bytes but carries {frame.buffer.nbytes}")
            targets.append((self.regions.find(b.dst, b.extent(b.dst_stride)), b, frame.buffer))
        self._write_local(targets)
        reply({"ok": True})

    def _write_local(self, targets: list[tuple[MemoryRegion, StridedBlock, memoryview]]) -> None:
        cuda_targets = []
        for region, b, data in targets:
            if region.is_cuda:
                cuda_targets.append((region, b, data))
            elif b.count == 1:
                host_view(b.dst, b.length)[:] = data
            else:
                host_block(b.dst, b, b.dst_stride, host_view)[...] = np.frombuffer(data, np.uint8).reshape(b.count, -1)
        if not cuda_targets:
            return
        total = sum(b.nbytes for _, b, _ in cuda_targets)
        staged = torch.empty(total, dtype=torch.uint8)
        view = memoryview(staged.numpy())
        offset = 0
        for _, b, data in cuda_targets:
            view[offset : offset + b.nbytes] = data
            offset += b.nbytes
        devices = {region.device for region, *_ in cuda_targets}
        on_device = {device: staged.to(device) for device in devices}
        offset = 0
        for region, b, _ in cuda_targets:
            chunk = on_device[region.device][offset : offset + b.nbytes].view(b.count, b.length)
            self._strided(region, b.dst, b, b.dst_stride).copy_(chunk)
            offset += b.nbytes
        for device in devices:
            torch.cuda.synchronize(device)

    def _strided(self, region: MemoryRegion, ptr: int, block: StridedBlock, stride: int) -> torch.Tensor:
        """A (count, length) view of the block's spans at `ptr` in a CUDA region (no copy)."""
        whole = self._tensor(region)
        return whole.as_strided((block.count, block.length), (max(stride, 1), 1),
                                whole.storage_offset() + ptr - region.ptr)

    def _tensor(self, region: MemoryRegion) -> torch.Tensor:
        with self._lock:
            t = self._region_tensors.get(region.ptr)
            if t is None:
                t = self._region_tensors[region.ptr] = region_tensor(region)
            return t

    def release(self) -> None:
        self._region_tensors.clear()
