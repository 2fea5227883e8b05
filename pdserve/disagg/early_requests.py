"""The prefill's store of transfer_requests that arrived before their own HTTP request, bounded and expiring.

A decode may claim a room a moment before the router's request reaches the prefill, so the claim is kept until
the request comes. Anyone who reaches the control port can send claims for rooms that never come, so the store
holds at most `max_count` claims and `max_pages` destination pages in all, each for `ttl_s`; when full, the
oldest claims make room. The rooms of claims dropped unused (and where to reach their decode) are remembered, as
many again, so that a later abort from the decode can be confirmed: nothing was written for them.

The mirror case: a request the prefill failed before its claim came (its grammar did not compile here) leaves its
`failed` answer here, as many and as long as claims, for the claim to be answered with at once.
"""

from __future__ import annotations

from collections import OrderedDict

from pdserve.disagg.control_messages import Failed, TransferRequest

MAX_EARLY_REQUESTS = 1024


class EarlyRequests:
    def __init__(self, max_pages: int, ttl_s: float, max_count: int = MAX_EARLY_REQUESTS):
        self.max_pages, self.ttl_s, self.max_count = max_pages, ttl_s, max_count
        self._kept: OrderedDict[int, tuple[TransferRequest, float]] = OrderedDict()  # room -> (claim, deadline)
        self.pages = 0
        self._dropped: OrderedDict[int, str] = OrderedDict()  # room -> the decode's control endpoint
        self._refusals: OrderedDict[int, tuple[Failed, float]] = OrderedDict()  # room -> (answer, deadline)

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
        while self._refusals and next(iter(self._refusals.values()))[1] < now:
            self._refusals.popitem(last=False)

    def refuse(self, answer: Failed, now: float) -> None:
        """Keep `answer` for the claim of its room until `now + ttl_s` (the oldest make room when full)."""
        self._refusals.pop(answer.room, None)
        if len(self._refusals) >= self.max_count:
            self._refusals.popitem(last=False)
        self._refusals[answer.room] = (answer, now + self.ttl_s)

    def take_refusal(self, room: int) -> Failed | None:
        entry = self._refusals.pop(room, None)
        return entry[0] if entry is not None else None

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
