"""The decode's receive staging (`--disaggregation-staging-mb`): a handoff's KV lands packed in one slot of a
registered arena, whatever its pages' placement, and is unpacked into the pages with one `index_copy_` before the
request commits.

Packing on the prefill alone leaves one span per run of the decode's pages, layer and K/V (64 for a 2k-token llama
KV in one run, 64 per run more when the decode's pages are scattered). Into a slot the prefill writes one span per
layer and K/V of each piece, and for a prompt it pushes in one piece (no layer-wise push) the spans are as many as
the slot's layers times two, whatever the pages: the decode's fragmentation costs nothing on the link.

Slot layout: [K/V, layer, page position in the request, page bytes], whole tokens of this rank's heads (a prefill
of another TP size writes head slices into the pages instead). Every rank of a TP decode takes the same slot in the
same order, so the leader's one `transfer_request` names it for all ranks. A slot is reserved with the pages, given
back with them when the handoff fails (after the fence, if the prefill may still write), and after its unpack once
that unpack has run on the device (`collect`, at the next pre-allocation), never sooner: a prefill could otherwise
write the next request's KV into bytes the unpack has yet to read.
"""

from __future__ import annotations

import torch

from pdserve.disagg.transfer.base import StagedDestination, TransferEngine
from pdserve.disagg.transfer.packing import StagingArena, kv_words
from pdserve.mem_cache.kv_pool import KVPool


class ReceiveStaging:
    def __init__(self, engine: TransferEngine, pool: KVPool, nbytes: int):
        self.pool = pool
        self.layout = pool.layout
        self.buffer = torch.empty(nbytes - nbytes % 256, dtype=torch.uint8, device=pool.buffer.device)
        self.arena = StagingArena(self.buffer.numel(), timeout_s=0.0)  # never waits: no slot, pages in place
        engine.register(self.buffer.data_ptr(), self.buffer.numel(), str(self.buffer.device))
        self.slots: dict[int, tuple[int, int]] = {}  # room -> (offset, pages)
        self._unpacked: list[tuple[int, torch.cuda.Event | None]] = []  # (offset, event after its unpack)
        self._pool_words = kv_words(pool.buffer.view(torch.uint8).view(-1), self.layout)

    @property
    def base(self) -> int:
        return self.buffer.data_ptr()

    def reserve(self, room: int, num_pages: int) -> int | None:
        """A slot for `num_pages` pages of the room's KV; its offset, or None when the arena has no room."""
        offset = self.arena.try_acquire(self._slot_bytes(num_pages)) if num_pages else None
        if offset is not None:
            self.slots[room] = (offset, num_pages)
        return offset

    def destination(self, room: int, rank_base: int) -> StagedDestination:
        """The room's slot on a rank whose staging starts at `rank_base` (the prefill's view)."""
        offset, pages = self.slots[room]
        return StagedDestination(rank_base + offset, pages)

    def unpack(self, room: int, pages: list[int]) -> None:
        """Copy the room's staged KV into `pages` (the pages of the slot's positions, in order) on the current
        stream; the slot comes free at the next `collect` after the copy ran."""
        offset, num_pages = self.slots.pop(room)
        if len(pages) != num_pages:
            raise ValueError(f"room {room}: {len(pages)} pages for a slot of {num_pages}")
        raw = self.buffer[offset : offset + self._slot_bytes(num_pages)]
        index = torch.tensor(pages, dtype=torch.long, device=self.buffer.device)
        self._pool_words.index_copy_(2, index, kv_words(raw, self.layout, num_pages))
        event = None
        if self.buffer.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._unpacked.append((offset, event))

    def drop(self, room: int) -> None:
        """Give the room's slot back unread: its handoff failed and its prefill writes nothing more."""
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

    def _slot_bytes(self, num_pages: int) -> int:
        return 2 * self.layout.num_layers * num_pages * self.layout.page_bytes
