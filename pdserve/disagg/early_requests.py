"""The prefill's store of transfer_requests that arrived before their own HTTP request, bounded and expiring.

A decode may claim a room a moment before the router's request reaches the prefill, so the claim is kept until
the request comes. Anyone who reaches the control port can send claims for rooms that never come, so the store
holds at most `max_count` claims and `max_pages` destination pages in all, each for `ttl_s`; when full, the
oldest claims make room. The rooms of claims dropped unused (and where to reach their decode) are remembered, as
many again, so that a later abort from the decode can be confirmed: nothing was written for them.

Two mirror cases, each kept as many and as long as claims (`ExpiringRooms`): a request the prefill failed before its
claim came (its grammar did not compile here) leaves its `failed` answer, for the claim to be answered with at once;
an `abort` from a decode that failed the request before the prefill got it (its grammar did not compile there)
waits for the request, which then ends at once.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

from pdserve.disagg.control_messages import Abort, Failed, TransferRequest

MAX_EARLY_REQUESTS = 1024
T = TypeVar("T")


class ExpiringRooms(Generic[T]):
    """One value per room, each for `ttl_s`; at most `max_count`, the oldest make room."""

    def __init__(self, ttl_s: float, max_count: int = MAX_EARLY_REQUESTS):
        self.ttl_s, self.max_count = ttl_s, max_count
        self._kept: OrderedDict[int, tuple[T, float]] = OrderedDict()  # room -> (value, deadline)

    def put(self, room: int, value: T, now: float) -> None:
        self._kept.pop(room, None)
        if len(self._kept) >= self.max_count:
            self._kept.popitem(last=False)
        self._kept[room] = (value, now + self.ttl_s)

    def take(self, room: int) -> T | None:
        entry = self._kept.pop(room, None)
        return entry[0] if entry is not None else None

    def expire(self, now: float) -> None:
        while self._kept and next(iter(self._kept.values()))[1] < now:
            self._kept.popitem(last=False)

    def items(self) -> list[tuple[int, T]]:
        return [(room, value) for room, (value, _) in self._kept.items()]

    def __len__(self) -> int:
        return len(self._kept)


class EarlyRequests:
    def __init__(self, max_pages: int, ttl_s: float, max_count: int = MAX_EARLY_REQUESTS):
        self.max_pages, self.ttl_s, self.max_count = max_pages, ttl_s, max_count
        self._kept: OrderedDict[int, tuple[TransferRequest, float]] = OrderedDict()  # room -> (claim, deadline)
        self.pages = 0
        self._dropped: OrderedDict[int, str] = OrderedDict()  # room -> the decode's control endpoint
        self.refusals: ExpiringRooms[Failed] = ExpiringRooms(ttl_s, max_count)  # the prefill's answers to claims
        self.aborts: ExpiringRooms[Abort] = ExpiringRooms(ttl_s, max_count)  # decode aborts of requests not here yet

    def add(self, msg: TransferRequest, now: float) -> bool:
        """Keep `msg` until `now + ttl_s`; False (dropped) when it alone needs more pages than the store holds."""
        if len(msg.dst_pages) > self.max_pages:
            return False
        self.pop(msg.room)
        while self._kept and (len(self._kept) >= self.max_count or self.pages + len(msg.dst_pages) > self.max_pages):
            self._drop(next(iter(self._kept)))
        self._kept[msg.room] = (msg, now + self.ttl_s)
        self.pages += len(msg.dst_pages)
        return True

    def pop(self, room: int) -> TransferRequest | None:
        entry = self._kept.pop(room, None)
        if entry is None:
            return None
        self.pages -= len(entry[0].dst_pages)
        return entry[0]

    def expire(self, now: float) -> None:
        while self._kept and next(iter(self._kept.values()))[1] < now:
            self._drop(next(iter(self._kept)))
        self.refusals.expire(now)
        self.aborts.expire(now)

    def _drop(self, room: int) -> None:
        self._dropped[room] = self.pop(room).control
        if len(self._dropped) > self.max_count:
            self._dropped.popitem(last=False)

    def take_control(self, room: int) -> str | None:
        """The decode's control endpoint of a claim kept or dropped unused for `room`, forgotten here."""
        claim = self.pop(room)
        return claim.control if claim is not None else self._dropped.pop(room, None)

    def __len__(self) -> int:
        return len(self._kept)
