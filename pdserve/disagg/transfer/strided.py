"""Spans that repeat at a fixed stride, folded into blocks: a head range of a page run is one span per token, each
`token_bytes` after the last on both sides, and a host-staged engine moves such a block as one strided copy and one
frame instead of thousands of each."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.disagg.transfer.base import TransferError
from pdserve.disagg.control_transport import parse_spans


@dataclass(frozen=True, slots=True)
class StridedBlock:
    """`count` spans of `length` bytes, the i-th at `src + i * src_stride` and `dst + i * dst_stride`."""

    src: int
    dst: int
    length: int
    count: int = 1
    src_stride: int = 0
    dst_stride: int = 0

    @property
    def nbytes(self) -> int:
        return self.length * self.count

    def extent(self, stride: int) -> int:
        """Bytes from the first span's start to the last one's end, on the side with this stride."""
        return (self.count - 1) * stride + self.length


def strided_blocks(src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int],
                   fold_below: int) -> list[StridedBlock]:
    """The spans, in order, as blocks of consecutive spans of one length under `fold_below` bytes whose starts
    advance by the same non-overlapping strides on both sides (longer spans stay blocks of one)."""
    if not lengths:
        return []
    s, d, n = (np.asarray(x, dtype=np.int64) for x in (src_ptrs, dst_ptrs, lengths))
    step_s, step_d = np.diff(s), np.diff(d)
    # pair i (span i -> i + 1) can join a block: same short length, forward strides that do not overlap
    joinable = (n[1:] == n[:-1]) & (n[:-1] < fold_below) & (step_s >= n[:-1]) & (step_d >= n[:-1])
    # pair i continues pair i - 1's block: both joinable with the same strides
    same = np.zeros(len(joinable), dtype=bool)
    same[1:] = joinable[1:] & joinable[:-1] & (step_s[1:] == step_s[:-1]) & (step_d[1:] == step_d[:-1])
    breaks = np.flatnonzero(~same)  # the pairs that cannot continue the block before them
    blocks = []
    i = 0
    while i < len(n):
        if i < len(joinable) and joinable[i]:
            nxt = np.searchsorted(breaks, i + 1)
            last_pair = (breaks[nxt] - 1) if nxt < len(breaks) else len(joinable) - 1
            count = int(last_pair - i + 2)
            blocks.append(StridedBlock(int(s[i]), int(d[i]), int(n[i]), count, int(step_s[i]), int(step_d[i])))
            i += count
        else:
            blocks.append(StridedBlock(int(s[i]), int(d[i]), int(n[i])))
            i += 1
    return blocks


def block_to_wire(block: StridedBlock) -> list[int]:
    """The destination side of a block, as the receiver gets it: [ptr, length, count, stride]."""
    return [block.dst, block.length, block.count, block.dst_stride]


def parse_blocks(header: dict, key: str = "dst") -> list[StridedBlock]:
    """Destination blocks [ptr, length, count, stride] from a peer's header, each well-formed (the receiver still
    checks where they land)."""
    blocks = []
    for ptr, length, count, stride in parse_spans(header, key, width=4):
        if length <= 0 or count <= 0 or (count > 1 and stride < length):
            raise TransferError(f"block {[ptr, length, count, stride]}: length and count must be positive, "
                                "spans must not overlap")
        blocks.append(StridedBlock(0, ptr, length, count, 0, stride))
    return blocks


def host_block(ptr: int, block: StridedBlock, stride: int, view) -> np.ndarray:
    """A (count, length) uint8 array over the block's spans at `ptr` in host memory (no copy); `view(ptr, n)` is
    a writable memoryview of n bytes there."""
    data = np.frombuffer(view(ptr, block.extent(stride)), dtype=np.uint8)
    return np.lib.stride_tricks.as_strided(data, (block.count, block.length), (stride, 1))
