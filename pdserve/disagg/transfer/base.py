"""The transfer-engine interface: one-sided batched writes from registered local memory into a peer's
registered memory, plus the page-run planning that turns KV page ids into byte spans.

Addresses are plain ints. Everything that arrives from another process (page ids, pointers, lengths,
layout descriptions) is checked here before any byte moves; violations raise `TransferError`.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from pdserve.mem_cache.kv_pool import KVLayout


class TransferError(RuntimeError):
    """A transfer that was refused, failed or timed out. The KV pages it targeted hold garbage."""


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    ptr: int
    length: int
    device: str  # "cpu" or "cuda:N"

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def contains(self, ptr: int, length: int) -> bool:
        return self.ptr <= ptr and ptr + length <= self.ptr + self.length


class RegionTable:
    """Registered, non-overlapping memory regions; answers "which region holds this span" or raises."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._regions: list[MemoryRegion] = []

    def add(self, ptr: int, length: int, device: str) -> MemoryRegion:
        if ptr <= 0 or length <= 0:
            raise TransferError(f"cannot register region ptr={ptr:#x} length={length}")
        region = MemoryRegion(ptr, length, str(torch.device(device)))
        i = bisect.bisect_left(self._starts, ptr)
        neighbours = self._regions[max(i - 1, 0) : i + 1]
        if any(r.ptr < ptr + length and ptr < r.ptr + r.length for r in neighbours):
            raise TransferError(f"region ptr={ptr:#x} length={length} overlaps a registered region")
        self._starts.insert(i, ptr)
        self._regions.insert(i, region)
        return region

    def remove(self, region: MemoryRegion) -> None:
        """Forget a region whose registration with the engine itself failed."""
        i = self._regions.index(region)
        del self._starts[i], self._regions[i]

    def find(self, ptr: int, length: int) -> MemoryRegion:
        """The region that holds all of [ptr, ptr + length); lengths must be positive."""
        if not isinstance(ptr, int) or not isinstance(length, int) or length <= 0:
            raise TransferError(f"bad span ptr={ptr!r} length={length!r}")
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0 or not self._regions[i].contains(ptr, length):
            raise TransferError(f"span ptr={ptr:#x} length={length} lies outside every registered region")
        return self._regions[i]

    def __iter__(self):
        return iter(self._regions)

    def __len__(self) -> int:
        return len(self._regions)


def check_batch(src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]) -> None:
    """Matching lists, and destination spans that do not overlap: a backend may copy a batch's spans in any
    order or all at once (mooncake's batched copies do), so two spans writing the same byte leave it undefined."""
    if not len(src_ptrs) == len(dst_ptrs) == len(lengths):
        raise TransferError(
            f"batch lists differ in length: {len(src_ptrs)} src, {len(dst_ptrs)} dst, {len(lengths)} lengths"
        )
    if len(dst_ptrs) > 1:
        _check_disjoint(dst_ptrs, lengths)


def _check_disjoint(dst_ptrs: list[int], lengths: list[int]) -> None:
    starts = np.asarray(dst_ptrs, dtype=np.int64)
    order = np.argsort(starts, kind="stable")
    starts = starts[order]
    ends = starts + np.asarray(lengths, dtype=np.int64)[order]
    clash = np.flatnonzero(starts[1:] < ends[:-1])
    if clash.size:
        i = int(clash[0])
        raise TransferError(f"destination spans overlap: [{starts[i]:#x}, {ends[i]:#x}) and "
                            f"[{starts[i + 1]:#x}, {ends[i + 1]:#x}) in one write")


class TransferEngine(ABC):
    """Moves bytes from registered local memory into registered memory of a peer (push).

    The receiving side only needs to be registered and alive; `write` on the sending side is synchronous:
    when it returns, the bytes are in the peer's memory (and visible to the peer's CUDA streams).
    `write` is not thread-safe: one caller thread per engine, or a lock around it.
    """

    name: ClassVar[str]

    def __init__(self) -> None:
        self.regions = RegionTable()

    def register(self, ptr: int, length: int, device: str = "cpu") -> None:
        """Register a buffer once (the whole KV buffer, each aux buffer) before any transfer touches it."""
        self.regions.add(ptr, length, device)

    @abstractmethod
    def session_id(self) -> str:
        """What a peer passes to `write` to reach this engine, e.g. "127.0.0.1:15123"."""

    def connect(self, peer_session: str) -> None:
        """Optional per-peer setup (sockets, communicators); `write` connects lazily otherwise."""

    @abstractmethod
    def write(self, peer_session: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]) -> None:
        """Copy each local [src, src+len) into the peer's [dst, dst+len); raises TransferError."""

    def has_spans_to_write(self, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]) -> bool:
        """Whether a write batch moves anything, once its lists match and every source span lies in memory
        registered here (a bad pointer fails here, never as a read of someone else's memory)."""
        check_batch(src_ptrs, dst_ptrs, lengths)
        for ptr, n in zip(src_ptrs, lengths):
            self.regions.find(ptr, n)
        return bool(lengths)

    @abstractmethod
    def transport(self) -> str:
        """The wire actually used: "rdma", "nvlink_intra", "nvlink", "tcp", "nccl" or "fake"."""

    @abstractmethod
    def close(self) -> None:
        """Release sockets, threads, communicators and registrations; idempotent."""


# ---------------------------------------------------------------------------------------------------
# KV page runs


PageRun = tuple[int, int, int]  # (src_start_page, dst_start_page, num_pages)

_KV_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "uint8", "int8")
}


def coalesce_page_runs(src_pages: list[int], dst_pages: list[int]) -> list[PageRun]:
    """Merge positions where both the source and the destination page ids advance by one."""
    if len(src_pages) != len(dst_pages):
        raise TransferError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    runs: list[PageRun] = []
    for s, d in zip(src_pages, dst_pages):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


@dataclass(frozen=True, slots=True)
class KVRegion:
    """Where one side's KV buffer lives: base pointer plus the layout of `KVPool.buffer`."""

    base: int
    layout: KVLayout

    def page_ptr(self, kv: int, layer: int, page: int) -> int:
        return self.base + self.layout.region_offset(kv, layer) + page * self.layout.page_bytes


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """`count` KV heads from the source pool's head index `src_head` on into the destination's from `dst_head` on
    (indexes within each pool: a tensor-parallel rank's pool holds its own heads only)."""

    src_head: int
    dst_head: int
    count: int


@dataclass(frozen=True, slots=True)
class StagedDestination:
    """A handoff's slot in the decode's receive staging (transfer/receive_staging.py): `num_pages` pages of every
    layer's K and V of whole tokens, laid out [K/V, layer, page position, page bytes] from `base`; a piece writes
    the positions from `first_position` on, in its page order."""

    base: int
    num_pages: int
    first_position: int = 0


@dataclass(frozen=True, slots=True)
class KVTarget:
    """A decode rank a prefill rank writes into: its transfer session, its KV buffer and the heads it takes from
    this prefill rank (none: that decode rank gets its heads from other prefill ranks), and the handoff's slot in
    its receive staging, if it gave one."""

    session: str
    region: KVRegion
    heads: Sequence[HeadSlice]
    staged: StagedDestination | None = None


def kv_write_requests(
    src: KVRegion, dst: KVRegion, runs: list[PageRun], layers: range | None = None,
    heads: Sequence[HeadSlice] | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """Byte spans for every run in each layer's K and V (all layers by default), in one batch; page 0 is never
    transferred. `heads` (default: every head, the same on both sides) picks head ranges out of each token.

    The pool stores a token's heads side by side (`[slots, heads, head_dim]`), so a slice that is a whole token
    on both sides moves as one span per page run, and any other slice as one span per token: the transfer
    engine reads and writes the heads in place, no gather copy is made."""
    heads = checked_heads(src.layout, dst.layout, heads)
    for run in runs:
        check_run(run, src.layout.num_pages, dst.layout.num_pages)
    spans: tuple[list[int], list[int], list[int]] = ([], [], [])
    for kv in (0, 1):
        for layer in layers if layers is not None else range(src.layout.num_layers):
            for head_slice in heads:
                _add_spans(spans, src.page_ptr(kv, layer, 0), dst.page_ptr(kv, layer, 0), src.layout, dst.layout,
                           runs, head_slice)
    return spans


def checked_heads(src: KVLayout, dst: KVLayout, heads: Sequence[HeadSlice] | None) -> Sequence[HeadSlice]:
    geometry = (src.num_layers, src.page_size, src.head_dim, src.itemsize)
    if geometry != (dst.num_layers, dst.page_size, dst.head_dim, dst.itemsize):
        raise TransferError(
            f"KV layouts differ: {src.num_layers} layers x {src.page_size}-token pages x {src.head_dim}-dim heads of "
            f"{src.itemsize} B locally, {dst.num_layers} x {dst.page_size} x {dst.head_dim} of {dst.itemsize} B "
            "at the peer"
        )
    if heads is None:
        if src.num_kv_heads != dst.num_kv_heads:
            raise TransferError(f"{src.num_kv_heads} KV heads locally but {dst.num_kv_heads} at the peer: "
                                "say which heads go where")
        return [HeadSlice(0, 0, src.num_kv_heads)]
    for h in heads:
        if h.count <= 0 or h.src_head < 0 or h.dst_head < 0 or h.src_head + h.count > src.num_kv_heads \
                or h.dst_head + h.count > dst.num_kv_heads:
            raise TransferError(f"head slice {h} out of range: {src.num_kv_heads} heads locally, "
                                f"{dst.num_kv_heads} at the peer")
    return heads


def _add_spans(spans, src_layer: int, dst_layer: int, src: KVLayout, dst: KVLayout, runs: list[PageRun],
               h: HeadSlice) -> None:
    src_ptrs, dst_ptrs, lengths = spans
    head_bytes = src.head_dim * src.itemsize
    src_first, dst_first = src_layer + h.src_head * head_bytes, dst_layer + h.dst_head * head_bytes
    src_page, dst_page = src.page_bytes, dst.page_bytes
    if h.count == src.num_kv_heads == dst.num_kv_heads:  # whole tokens on both sides: one span per run
        for s, d, n in runs:
            src_ptrs.append(src_first + s * src_page)
            dst_ptrs.append(dst_first + d * dst_page)
            lengths.append(n * src_page)
        return
    src_token, dst_token, page_size = src.token_bytes, dst.token_bytes, src.page_size
    for s, d, n in runs:  # one span per token
        tokens = n * page_size
        start_src, start_dst = src_first + s * src_page, dst_first + d * dst_page
        src_ptrs.extend(range(start_src, start_src + tokens * src_token, src_token))
        dst_ptrs.extend(range(start_dst, start_dst + tokens * dst_token, dst_token))
        lengths.extend([h.count * head_bytes] * tokens)


def check_run(run: PageRun, src_pages: int, dst_pages: int) -> None:
    if len(run) != 3 or not all(isinstance(x, int) and not isinstance(x, bool) for x in run):
        raise TransferError(f"malformed page run {run!r}")
    s, d, n = run
    if n <= 0 or s < 1 or d < 1 or s + n > src_pages or d + n > dst_pages:
        raise TransferError(
            f"page run (src={s}, dst={d}, n={n}) out of range: source has pages 1..{src_pages - 1}, "
            f"destination has pages 1..{dst_pages - 1}"
        )


def layout_from_description(desc: dict) -> KVLayout:
    """Rebuild a peer's KVLayout from `KVLayout.describe()` output received over the network."""
    fields = ("num_layers", "num_kv_heads", "head_dim", "page_size", "num_pages")
    if not isinstance(desc, dict):
        raise TransferError(f"KV layout description must be a dict, got {type(desc).__name__}")
    for name in fields:
        value = desc.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise TransferError(f"KV layout field {name} must be a positive int, got {value!r}")
    dtype = _KV_DTYPES.get(desc.get("dtype"))
    if dtype is None:
        raise TransferError(f"KV layout dtype {desc.get('dtype')!r} is not one of {sorted(_KV_DTYPES)}")
    return KVLayout(**{name: desc[name] for name in fields}, dtype=dtype)


# ---------------------------------------------------------------------------------------------------
# raw memory views used by the host-staged backends


class _CudaSpan:
    """A raw device pointer exposed through __cuda_array_interface__ so torch can view it."""

    def __init__(self, ptr: int, length: int):
        self.__cuda_array_interface__ = {
            "shape": (length,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
        }


def region_tensor(region: MemoryRegion) -> torch.Tensor:
    """A uint8 tensor aliasing a registered region (no copy); indexes are byte offsets."""
    if region.is_cuda:
        return torch.as_tensor(_CudaSpan(region.ptr, region.length), device=region.device)
    return torch.frombuffer(host_view(region.ptr, region.length), dtype=torch.uint8)


def host_view(ptr: int, length: int) -> memoryview:
    """A writable byte memoryview of host memory at ptr (the caller has bounds-checked the span)."""
    import ctypes

    return memoryview((ctypes.c_char * length).from_address(ptr)).cast("B")
