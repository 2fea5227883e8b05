"""The prefill role's handoff phases that hold state of their own, each an object that enforces its invariant.

A PD request on the prefill server goes, in order (its `Handoff.poll` says where; `PeerLink.handoffs` indexes every
room in flight; `prefill.py` moves it):
  held back        BOOTSTRAPPING, not queued: `HeldBack`, until the budget of computing ahead has room for it or
                   its page list comes
  computing        queued in the scheduler, BOOTSTRAPPING until its page list comes, then WAITING_FOR_INPUT: the
                   pages computed so far are written once the list is known, later ones as they are computed; when
                   its decode offered a receive-staging slot, it is asked for as the computing begins and the
                   writes wait for the answer (`SlotAsks`)
  writing          TRANSFERRING: the last pages and the first token in flight; `FinalWrites` holds the `kv_done`
                   that waits for every rank's writes
  done             SUCCESS: the request ends here; its handoff is released once no write of it is in flight
  failed           FAILED: its pages stay held until no write of it is in flight, then its decode is told
"""

from __future__ import annotations

import math

from pdserve.disagg.control_messages import KVDone
from pdserve.disagg.handoff import Handoff


class HeldBack:
    """The handoffs not queued for prefill yet, oldest first, and the budget of computing ahead of page lists.
    Invariants: rooms are queued oldest first, none past one that does not fit, while the pages of the requests
    queued before their page list came (their whole prompts') stay within `max_pages_ahead` (`due`); a room leaves
    when it is queued, when its page list comes or when it fails (`leave`)."""

    def __init__(self, max_pages_ahead: int, page_size: int) -> None:
        self.max_pages_ahead = max_pages_ahead
        self._page_size = page_size
        self._rooms: dict[int, Handoff] = {}

    def hold(self, h: Handoff) -> None:
        self._rooms[h.room] = h

    def due(self, bootstrapping: list[Handoff]) -> list[Handoff]:
        """The held handoffs that fit in the budget now, taken, oldest first; `bootstrapping` (the handoffs without
        a page list) holds the ones already queued ahead."""
        ahead = sum(prompt_pages(h, self._page_size) for h in bootstrapping if h.room not in self._rooms)
        due = []
        for h in self._rooms.values():
            ahead += prompt_pages(h, self._page_size)
            if ahead > self.max_pages_ahead:
                break
            due.append(h)
        for h in due:
            del self._rooms[h.room]
        return due

    def leave(self, room: int) -> Handoff | None:
        """The held handoff of `room`, taken (None when it is not held)."""
        return self._rooms.pop(room, None)

    def handoffs(self) -> list[Handoff]:
        return list(self._rooms.values())

    def __contains__(self, room: int) -> bool:
        return room in self._rooms

    def __len__(self) -> int:
        return len(self._rooms)


class SlotAsks:
    """The rooms whose decode offered a receive-staging slot, until their writes may begin. Invariants: a room's
    slot is asked for once (`ask` takes the offer); while the answer has not come its writes wait (`holds`), at most
    `wait_s` from the first write held (`expired`), then go into the pages; an answer counts only while they wait
    (`answered`); a room leaves when it fails (`drop`)."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self._offered: set[int] = set()
        self._asked: dict[int, float | None] = {}  # room -> when its held writes stop waiting (None: none held yet)

    def offer(self, room: int) -> None:
        self._offered.add(room)

    def ask(self, room: int) -> bool:
        """Take the room's offer: True when it had one (the slot is asked for now)."""
        if room not in self._offered:
            return False
        self._offered.discard(room)
        self._asked[room] = None
        return True

    def holds(self, room: int, now: float) -> bool:
        """Whether the room's writes wait for the answer; the first write held starts the wait."""
        if room not in self._asked:
            return False
        if self._asked[room] is None:
            self._asked[room] = now + self.wait_s
        return True

    def waiting(self, room: int) -> bool:
        return room in self._asked

    def answered(self, room: int) -> bool:
        """Take the room's answer: True when its writes still waited for it (else it came too late)."""
        return self._asked.pop(room, False) is not False

    def expired(self, now: float) -> list[int]:
        """The rooms whose held writes waited `wait_s` without an answer, taken."""
        due = [room for room, until in self._asked.items() if until is not None and now > until]
        for room in due:
            del self._asked[room]
        return due

    def seconds_left(self, now: float) -> float | None:
        """Until the first held writes stop waiting (None: none wait)."""
        held = [until for until in self._asked.values() if until is not None]
        return max(min(held) - now, 0.0) if held else None

    def drop(self, room: int) -> None:
        self._offered.discard(room)
        self._asked.pop(room, None)


class FinalWrites:
    """The `kv_done` of the rooms written by more than one writer (several ranks, or several decode ranks), by room,
    which the leader sends. A room's only writer sends its `kv_done` itself once its final write landed, and it
    never comes here (`hold_unless_sole`). Invariant: each is sent once, after every rank's writes landed (`due`
    takes it only then), and dropped when the handoff is released (`drop`)."""

    def __init__(self) -> None:
        self._rooms: dict[int, KVDone] = {}

    def hold_unless_sole(self, kv_done: KVDone, sole_writer: bool) -> KVDone | None:
        """The `kv_done` the room's only writer sends; else None, and it waits here for the leader."""
        if sole_writer:
            return kv_done
        self._rooms[kv_done.room] = kv_done
        return None

    def due(self, h: Handoff) -> KVDone | None:
        """h's `kv_done`, taken, once every rank's writes of it landed (None before, and when its writer sent it)."""
        if h.writes_in_flight > 0:
            return None
        return self._rooms.pop(h.room, None)

    def drop(self, room: int) -> None:
        self._rooms.pop(room, None)

    def __contains__(self, room: int) -> bool:
        return room in self._rooms


def prompt_pages(h: Handoff, page_size: int) -> int:
    """The pages of h's whole prompt."""
    return math.ceil(len(h.req.input_ids) / page_size)
