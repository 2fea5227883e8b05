"""Packed KV writes: scattered source pages gathered into a staging buffer, then written with one span per
destination run, layer and K/V, instead of one per run that is contiguous on both sides.

A transfer engine pays per span (mooncake's `nvlink_intra` about 3.6 µs, one CUDA copy each): a 2,048-token
llama-3.1-8b KV in 16-token pages is 8,192 spans when the prefill's pages are scattered, 64 once they are gathered
into the order of the decode's runs (its allocator hands out few long runs). The gather is one `index_select` per
head slice on the sender's device, over the pool's bytes in machine words whatever the KV dtype (FP8 pages travel
as they are), into a range of a bounded staging arena registered with the engine. The receiver sees an ordinary
write, and a piece that would not save spans is written in place as before. A piece for the decode's receive
staging (receive_staging.py) is always packed, into its slot: two spans per write, whatever the pages.

Staging layout of one piece, per head slice: [K/V, layer, page in destination order, token, head, byte].
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from pdserve.disagg.transfer.base import (
    HeadSlice,
    KVRegion,
    PageRun,
    StagedDestination,
    TransferEngine,
    TransferError,
    check_run,
    checked_heads,
    kv_write_requests,
    region_tensor,
)
from pdserve.mem_cache.kv_pool import KVLayout

STAGING_ALIGN = 256  # bytes; every staging range starts at a multiple (word-aligned views, coalesced copies)
MAX_STAGING_BYTES = 256 << 20  # a 2,048-token llama-3.1-8b KV: two writes of 128 MiB
MIN_STAGING_BYTES = 1 << 20

Spans = tuple[list[int], list[int], list[int]]


@dataclass(frozen=True, slots=True)
class KVPiece:
    """Page `runs` of this rank's heads into one target's pool: each layer of `layers`, K and V. `heads` as in
    `kv_write_requests` (None: every head, the same count on both sides). With `staged` the bytes go to the
    decode's receive staging instead of its pages, which the decode unpacks before it commits the request."""

    src: KVRegion
    dst: KVRegion
    runs: Sequence[PageRun]
    layers: range
    heads: Sequence[HeadSlice] | None = None
    staged: StagedDestination | None = None

    @property
    def num_pages(self) -> int:
        return sum(n for _, _, n in self.runs)

    def head_slices(self) -> Sequence[HeadSlice]:
        """The head slices, checked against both layouts, and the runs and layers checked against the pools."""
        heads = checked_heads(self.src.layout, self.dst.layout, self.heads)
        for run in self.runs:
            check_run(run, self.src.layout.num_pages, self.dst.layout.num_pages)
        if self.layers.step != 1 or not 0 <= self.layers.start < self.layers.stop <= self.src.layout.num_layers:
            raise TransferError(f"layers {self.layers} out of range for {self.src.layout.num_layers} layers")
        staged = self.staged
        if staged is not None and (not self.whole_tokens() or staged.first_position < 0
                                   or staged.first_position + self.num_pages > staged.num_pages):
            raise TransferError(f"{self.num_pages} pages of {len(heads)} head slices do not fit staged pages "
                                f"{staged.first_position}.. of {staged.num_pages} (whole tokens only)")
        return heads

    def page_bytes(self) -> int:
        """Bytes of one page of one layer's K (or V) this piece moves."""
        layout = self.src.layout
        heads = self.heads or [HeadSlice(0, 0, layout.num_kv_heads)]
        return layout.page_size * layout.head_dim * layout.itemsize * sum(h.count for h in heads)

    @property
    def nbytes(self) -> int:
        return 2 * len(self.layers) * self.num_pages * self.page_bytes()

    def spans(self) -> Spans:
        """The piece written in place: one span per run contiguous on both sides (or per token of a head slice)."""
        if self.staged is not None:
            raise TransferError("a piece for the decode's receive staging is written packed only")
        return kv_write_requests(self.src, self.dst, list(self.runs), self.layers, self.heads)

    def whole_tokens(self) -> bool:
        return self.heads is None or (len(self.heads) == 1 and self.heads[0].count == self.src.layout.num_kv_heads
                                      == self.dst.layout.num_kv_heads)


def staging_bytes(pool_bytes: int) -> int:
    """A prefill's staging arena: an eighth of its KV pool, within [MIN_STAGING_BYTES, MAX_STAGING_BYTES]."""
    return min(MAX_STAGING_BYTES, max(MIN_STAGING_BYTES, pool_bytes // 8))


def saves_spans(piece: KVPiece) -> bool:
    """Whether packing at least halves the piece's spans: whole tokens whose destination runs are fewer than half
    its runs contiguous on both sides (a head slice moves one span per token either way). A staged piece is
    always packed: the staging's layout is the packed one."""
    if piece.staged is not None:
        return True
    return piece.whole_tokens() and 2 * len(destination_runs(piece.runs)) <= len(piece.runs)


def destination_runs(runs: Sequence[PageRun]) -> list[tuple[int, int, int]]:
    """(position in the piece's page order, first destination page, pages) of each run of consecutive destination
    pages, whatever the source pages."""
    out: list[tuple[int, int, int]] = []
    position = 0
    for _, d, n in runs:
        if out and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((position, d, n))
        position += n
    return out


def source_pages(runs: Sequence[PageRun]) -> list[int]:
    return [p for s, _, n in runs for p in range(s, s + n)]


def split_piece(piece: KVPiece, max_bytes: int) -> list[KVPiece]:
    """The piece as parts of at most `max_bytes` each: layer groups, or page groups of one layer when one layer of
    every page is more."""
    per_layer = 2 * piece.num_pages * piece.page_bytes()
    if per_layer <= max_bytes:
        step = max_bytes // per_layer
        layers = piece.layers
        return [replace(piece, layers=range(start, min(start + step, layers.stop)))
                for start in range(layers.start, layers.stop, step)]
    pages_per_part = max_bytes // (2 * piece.page_bytes())
    if pages_per_part == 0:
        raise TransferError(f"one page ({2 * piece.page_bytes()} B with K and V) exceeds {max_bytes} B of staging")
    parts = []
    for group, runs in enumerate(_split_runs(piece.runs, pages_per_part)):
        staged = None if piece.staged is None else replace(
            piece.staged, first_position=piece.staged.first_position + group * pages_per_part)
        parts.extend(replace(piece, runs=runs, layers=range(layer, layer + 1), staged=staged)
                     for layer in piece.layers)
    return parts


def _split_runs(runs: Sequence[PageRun], pages: int) -> list[list[PageRun]]:
    groups: list[list[PageRun]] = [[]]
    room = pages
    for s, d, n in runs:
        while n:
            if room == 0:
                groups.append([])
                room = pages
            take = min(n, room)
            groups[-1].append((s, d, take))
            s, d, n, room = s + take, d + take, n - take, room - take
    return groups


class StagingArena:
    """First-fit byte ranges of a fixed buffer for concurrent writers. A writer that finds no range free waits for
    one (back-pressure) up to `timeout_s`, then fails its write."""

    def __init__(self, size: int, timeout_s: float):
        self.size = size
        self.timeout_s = timeout_s
        self._free: list[tuple[int, int]] = [(0, size)]  # (start, length), sorted, never adjacent
        self._taken: dict[int, int] = {}
        self._cond = threading.Condition()

    @property
    def bytes_in_use(self) -> int:
        with self._cond:
            return sum(self._taken.values())

    def try_acquire(self, nbytes: int) -> int | None:
        """The start of a free range of `nbytes`, now taken, or None at once when none is free."""
        with self._cond:
            return self._take(_aligned(nbytes)) if 0 < nbytes <= self.size else None

    def acquire(self, nbytes: int) -> int:
        """The start of a free range of `nbytes` (rounded up to STAGING_ALIGN), now taken."""
        n = _aligned(nbytes)
        if not 0 < n <= self.size:
            raise TransferError(f"cannot stage {nbytes} B in an arena of {self.size} B")
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while True:
                start = self._take(n)
                if start is not None:
                    return start
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferError(f"no {n} B of KV staging came free within {self.timeout_s:.1f}s "
                                        f"({sum(self._taken.values())} of {self.size} B in use)")
                self._cond.wait(remaining)

    def _take(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (start + n, length - n)
                self._taken[start] = n
                return start
        return None

    def release(self, start: int) -> None:
        with self._cond:
            n = self._taken.pop(start)
            self._free.append((start, n))
            self._free.sort()
            free: list[tuple[int, int]] = []
            for s, length in self._free:
                if free and free[-1][0] + free[-1][1] == s:
                    free[-1] = (free[-1][0], free[-1][1] + length)
                else:
                    free.append((s, length))
            self._free = free
            self._cond.notify_all()


class KVMover:
    """Writes KV pieces through a transfer engine, packed where that saves spans. Safe to call from several writer
    threads: each packs on its own CUDA stream into its own range of the shared staging arena. One mover per
    engine: its staging stays registered with the engine for the engine's life."""

    def __init__(self, engine: TransferEngine, device: torch.device | str, staging_bytes: int, timeout_s: float):
        self.engine = engine
        self.device = torch.device(device)
        staging_bytes -= staging_bytes % STAGING_ALIGN
        self.staging = torch.empty(staging_bytes, dtype=torch.uint8, device=self.device)
        self.arena = StagingArena(staging_bytes, timeout_s)
        engine.register(self.staging.data_ptr(), staging_bytes, str(self.device))
        self._pools: dict[tuple[int, KVRegion], torch.Tensor] = {}  # (registered region, pool) -> its words
        self._lock = threading.Lock()
        self._local = threading.local()  # each writer thread's CUDA stream

    @property
    def max_chunk(self) -> int:
        """The most one write stages at once: half the arena, so that two writers can pack at the same time."""
        return self.arena.size // 2

    def write(self, peer_session: str, pieces: Sequence[KVPiece], pack: bool | None = None) -> int:
        """Every piece into the peer's memory, packed where that saves spans (`pack` None), always (True) or never
        (False); returns the bytes moved. Raises TransferError."""
        packs = [saves_spans(p) if pack is None else pack for p in pieces]
        direct = [p for p, packed in zip(pieces, packs) if not packed]
        if direct:
            self.engine.write(peer_session, *_joined([p.spans() for p in direct]))
        packed = [part for p, packed in zip(pieces, packs) if packed for part in split_piece(p, self.max_chunk)]
        for chunk in _chunks(packed, self.max_chunk):
            self._write_packed(peer_session, chunk)
        return sum(p.nbytes for p in pieces)

    def _write_packed(self, peer_session: str, parts: list[KVPiece]) -> None:
        sizes = [_aligned(p.nbytes) for p in parts]
        start = self.arena.acquire(sum(sizes))
        try:
            spans: Spans = ([], [], [])
            stream = self._stream()
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                offset = start
                for part, size in zip(parts, sizes):
                    self._gather(part, offset, spans)
                    offset += size
            if stream is not None:
                stream.synchronize()  # the engine reads the staging bytes on streams of its own
            self.engine.write(peer_session, *merged(spans))
        finally:
            self.arena.release(start)

    def _gather(self, piece: KVPiece, offset: int, spans: Spans) -> None:
        """Copy the piece's pages into the staging arena at `offset`; add the spans that write them to the peer."""
        heads = piece.head_slices()
        layout, layers = piece.src.layout, piece.layers
        pool = self._pool_words(piece.src)
        words_per_head = pool.shape[-1]
        index = torch.tensor(source_pages(piece.runs), dtype=torch.long, device=self.device)
        runs = destination_runs(piece.runs)
        staging = self.staging.view(pool.dtype)
        word = pool.element_size()
        n = len(index)
        for h in heads:
            shape = (2, len(layers), n, layout.page_size, h.count, words_per_head)
            out = staging[offset // word : offset // word + math.prod(shape)].view(shape)
            torch.index_select(pool[:, layers.start : layers.stop, :, :, h.src_head : h.src_head + h.count], 2, index,
                               out=out)
            _add_packed_spans(spans, self.staging.data_ptr() + offset, piece, h, runs)
            offset += out.numel() * word

    def _pool_words(self, region: KVRegion) -> torch.Tensor:
        """The pool at `region` as [K/V, layer, page, token, head, word], in the widest word its bytes allow."""
        layout = region.layout
        nbytes = 2 * layout.num_layers * layout.layer_bytes
        registered = self.engine.regions.find(region.base, nbytes)  # the whole pool lies in registered memory
        key = (registered.ptr, region)
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = kv_words(region_tensor(registered)[region.base - registered.ptr :][:nbytes],
                                                   layout)
            return pool

    def _stream(self) -> torch.cuda.Stream | None:
        """This writer thread's CUDA stream (None on the CPU)."""
        if self.device.type != "cuda":
            return None
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.device)
        return stream


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def kv_words(raw: torch.Tensor, layout: KVLayout, num_pages: int | None = None) -> torch.Tensor:
    """`raw`, the uint8 bytes of a pool of `layout` (or of `num_pages` pages of each layer's K and V laid out the
    same way), as [K/V, layer, page, token, head, word] in the widest word its head bytes and address allow."""
    head_bytes = layout.head_dim * layout.itemsize
    word = next(w for w in (8, 4, 2, 1) if head_bytes % w == 0 and raw.data_ptr() % w == 0)
    pages = layout.num_pages if num_pages is None else num_pages
    return raw.view(_WORDS[word]).view(2, layout.num_layers, pages, layout.page_size, layout.num_kv_heads,
                                       head_bytes // word)


def _add_packed_spans(spans: Spans, staged: int, piece: KVPiece, h: HeadSlice,
                      runs: list[tuple[int, int, int]]) -> None:
    """Spans from one head slice's staged bytes at `staged` to the destination: one per layer and K/V into the
    decode's receive staging, else one per destination run, layer and K/V for whole tokens, else one per token."""
    src_ptrs, dst_ptrs, lengths = spans
    dst, layout = piece.dst, piece.dst.layout
    head_bytes = layout.head_dim * layout.itemsize
    token = h.count * head_bytes  # staged bytes of one token
    page = layout.page_size * token
    pages = piece.num_pages
    whole = token == layout.token_bytes
    for kv in (0, 1):
        for i, layer in enumerate(piece.layers):
            block = staged + (kv * len(piece.layers) + i) * pages * page
            if piece.staged is not None:
                there = piece.staged
                src_ptrs.append(block)
                dst_ptrs.append(there.base + ((kv * layout.num_layers + layer) * there.num_pages
                                              + there.first_position) * page)
                lengths.append(pages * page)
                continue
            for position, first, count in runs:
                src = block + position * page
                dst_ptr = dst.page_ptr(kv, layer, first) + h.dst_head * head_bytes
                if whole:
                    src_ptrs.append(src)
                    dst_ptrs.append(dst_ptr)
                    lengths.append(count * page)
                    continue
                tokens = count * layout.page_size
                src_ptrs.extend(range(src, src + tokens * token, token))
                dst_ptrs.extend(range(dst_ptr, dst_ptr + tokens * layout.token_bytes, layout.token_bytes))
                lengths.extend([token] * tokens)


def merged(spans: Spans) -> Spans:
    """The spans with each one that continues the previous on both sides joined to it (a staged piece of every
    page position: one span per K/V of its layers)."""
    out: Spans = ([], [], [])
    for src, dst, n in zip(*spans):
        if out[2] and out[0][-1] + out[2][-1] == src and out[1][-1] + out[2][-1] == dst:
            out[2][-1] += n
        else:
            out[0].append(src)
            out[1].append(dst)
            out[2].append(n)
    return out


def _joined(batches: list[Spans]) -> Spans:
    joined: Spans = ([], [], [])
    for batch in batches:
        for side, more in zip(joined, batch):
            side.extend(more)
    return joined


def _chunks(parts: list[KVPiece], max_bytes: int) -> list[list[KVPiece]]:
    """Consecutive parts grouped into writes of at most `max_bytes` staged."""
    chunks: list[list[KVPiece]] = []
    size = 0
    for part in parts:
        n = _aligned(part.nbytes)
        if not chunks or size + n > max_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(part)
        size += n
    return chunks


def _aligned(n: int) -> int:
    return -(-n // STAGING_ALIGN) * STAGING_ALIGN
