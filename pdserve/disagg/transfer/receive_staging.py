"""The decode's receive staging (`--disaggregation-staging-mb`): a handoff's KV lands packed in one slot of a
registered arena, whatever its pages' placement, and is unpacked into the pages with one `index_copy_` before the
request commits.

Packing on the prefill alone leaves one span per run of the decode's pages, layer and K/V (64 for a 2k-token llama
KV in one run, 64 per run more when the decode's pages are scattered). Into a slot the prefill writes one span per
layer and K/V of each piece, and for a prompt it pushes in one piece (no layer-wise push) the spans are as many as
the slot's layers times two, whatever the pages: the decode's fragmentation costs nothing on the link.

Slot layout: [K/V, layer, page position in the request, page bytes], whole tokens of this rank's heads (a prefill
of another TP size writes head slices into the pages instead). A slot is taken when the prefill starts computing the
request, not while it waits in the prefill's queue: the `transfer_request` offers one (`offer`), the prefill asks
for it as its computing begins (`ask`), and the decode gives it as soon as the arena has room, oldest ask first
(`grant`). The prefill writes into the slot if the answer came before its writes began, else into the pages, and its
`kv_done` says which: a slot given too late comes free then (`written_in_place`). Every rank of a TP decode takes
the same slot in the same order (asks and frees are step events), so the leader's one answer names it for all ranks.
A slot is given back with its pages when the handoff fails (after the fence, if the prefill may still write), and
after its unpack once that unpack has run on the device (`collect`), never sooner: a prefill could otherwise write
the next request's KV into bytes the unpack has yet to read.

On by default (`open_receive_staging`): an eighth of the KV pool, within [1 MiB, 2 GiB], on every backend that
moves bytes (the fake one moves none). The automatic size gives way to direct writes when the buffer cannot be
allocated or registered; a size the user gave fails the server instead.
"""

from __future__ import annotations

import logging

import torch

from pdserve.disagg.transfer.base import StagedDestination, TransferEngine, TransferError
from pdserve.disagg.transfer.packing import StagingArena, kv_words
from pdserve.mem_cache.kv_pool import KVPool

logger = logging.getLogger(__name__)

AUTO_MIN_BYTES = 1 << 20
AUTO_MAX_BYTES = 2 << 30  # sixteen 1k-token or two 8k-token llama-3.1-8b handoffs in flight


def receive_staging_bytes(staging_mb: int | None, pool_bytes: int) -> int:
    """`--disaggregation-staging-mb` in bytes; None (the default) sizes it from the pool: an eighth, at least
    AUTO_MIN_BYTES, at most AUTO_MAX_BYTES."""
    if staging_mb is not None:
        return staging_mb << 20
    return min(AUTO_MAX_BYTES, max(AUTO_MIN_BYTES, pool_bytes // 8))


def open_receive_staging(engine: TransferEngine, pool: KVPool, staging_mb: int | None) -> "ReceiveStaging | None":
    """The decode's receive staging as `--disaggregation-staging-mb` asks (None: the automatic size); None when it
    is 0, when the engine moves no bytes, or when the automatic size cannot be had (every handoff then writes its
    pages, as without staging)."""
    nbytes = receive_staging_bytes(staging_mb, pool.nbytes)
    if not nbytes or engine.name == "fake":
        return None
    try:
        return ReceiveStaging(engine, pool, nbytes)
    except (torch.OutOfMemoryError, TransferError) as exc:
        if staging_mb is not None:
            raise
        logger.warning("no receive staging (%d MiB on %s): %s; handoffs write their pages directly", nbytes >> 20,
                       pool.buffer.device, exc)
        return None


class ReceiveStaging:
    def __init__(self, engine: TransferEngine, pool: KVPool, nbytes: int):
        self.pool = pool
        self.layout = pool.layout
        self.buffer = torch.empty(nbytes - nbytes % 256, dtype=torch.uint8, device=pool.buffer.device)
        self.arena = StagingArena(self.buffer.numel(), timeout_s=0.0)  # never waits: asks do (`grant`)
        engine.register(self.buffer.data_ptr(), self.buffer.numel(), str(self.buffer.device))
        self.offers: dict[int, int] = {}  # room -> pages: a slot offered, not asked for yet
        self.asks: dict[int, int] = {}  # room -> pages: asked for, waiting for room in the arena, oldest first
        self.slots: dict[int, tuple[int, int]] = {}  # room -> (offset, pages): given
        self.staged = self.scattered = 0  # handoffs unpacked, those of them into scattered pages
        self.missed = self.late = 0  # offered handoffs written into their pages, those of them given a slot too late
        self._unpacked: list[tuple[int, torch.cuda.Event | None]] = []  # (offset, event after its unpack)
        self._pool_words = kv_words(pool.buffer.view(torch.uint8).view(-1), self.layout)

    @property
    def base(self) -> int:
        return self.buffer.data_ptr()

    def offer(self, room: int, num_pages: int) -> bool:
        """Offer the room a slot of `num_pages` pages, given once its prefill asks; False when no slot of that size
        fits the arena (or there is nothing to write)."""
        if not 0 < self.slot_bytes(num_pages) <= self.arena.size:
            return False
        self.offers[room] = num_pages
        return True

    def ask(self, room: int) -> bool:
        """The room's prefill asks for its offered slot, which waits for room in the arena (`grant`); False when
        none was offered or it was asked for already."""
        num_pages = self.offers.pop(room, None)
        if num_pages is not None:
            self.asks[room] = num_pages
        return num_pages is not None

    def grant(self) -> list[int]:
        """The rooms given their slot now: oldest ask first, none past one that does not fit yet."""
        granted = []
        for room, num_pages in self.asks.items():
            offset = self.arena.try_acquire(self.slot_bytes(num_pages))
            if offset is None:
                break
            self.slots[room] = (offset, num_pages)
            granted.append(room)
        for room in granted:
            del self.asks[room]
        return granted

    def destination(self, room: int, rank_base: int) -> StagedDestination:
        """The room's slot on a rank whose staging starts at `rank_base` (the prefill's view)."""
        offset, pages = self.slots[room]
        return StagedDestination(rank_base + offset, pages)

    def unpack(self, room: int, pages: list[int]) -> None:
        """Copy the room's staged KV into `pages` (the pages of the slot's positions, in order) on the current
        stream; the slot comes free at the next `collect` after the copy ran."""
        offset, num_pages = self.slots[room]
        if len(pages) != num_pages:
            raise ValueError(f"room {room}: {len(pages)} pages for a slot of {num_pages}")
        del self.slots[room]
        raw = self.buffer[offset : offset + self.slot_bytes(num_pages)]
        index = torch.tensor(pages, dtype=torch.long, device=self.buffer.device)
        self._pool_words.index_copy_(2, index, kv_words(raw, self.layout, num_pages))
        self.staged += 1
        self.scattered += any(b != a + 1 for a, b in zip(pages, pages[1:]))
        event = None
        if self.buffer.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._unpacked.append((offset, event))

    def written_in_place(self, room: int) -> None:
        """The room's KV went into its pages (its `kv_done` says so): what it was offered, asked for or given (too
        late, its prefill writing already) comes free unread."""
        offered = self.withdraw(room)
        given = self.slots.pop(room, None)
        if given is not None:
            self.arena.release(given[0])
        self.missed += offered or given is not None
        self.late += given is not None

    def withdraw(self, room: int) -> bool:
        """Forget the room's offer or ask (its handoff ended); a slot it was given stays until `drop`. Whether it
        had either."""
        return self.offers.pop(room, None) is not None or self.asks.pop(room, None) is not None

    def drop(self, room: int) -> None:
        """Forget the room and give its slot back unread: its handoff failed and its prefill writes nothing more."""
        self.withdraw(room)
        slot = self.slots.pop(room, None)
        if slot is not None:
            self.arena.release(slot[0])

    def collect(self) -> None:
        """Give back the slots whose unpack has run (waiting for it if it has not: every rank frees the same
        slots at the same step)."""
        for offset, event in self._unpacked:
            if event is not None:
                event.synchronize()
            self.arena.release(offset)
        self._unpacked.clear()

    def snapshot(self) -> dict:
        """For the decode's stats and /metrics: the arena's size, the slots handoffs hold (in flight or fenced), and
        since the staging was made the handoffs staged, those of them whose pages were not one run, those offered a
        slot and written into their pages (no room in the arena before their prefill's writes began), and those of
        them given their slot too late."""
        return {"bytes": self.buffer.numel(), "slots": len(self.slots), "staged": self.staged,
                "scattered": self.scattered, "missed": self.missed, "late": self.late}

    def slot_bytes(self, num_pages: int) -> int:
        """A slot's size: K and V of every layer of `num_pages` pages."""
        return 2 * self.layout.num_layers * num_pages * self.layout.page_bytes
