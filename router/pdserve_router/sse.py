"""Cutting a relayed SSE stream at event boundaries."""

from __future__ import annotations

EVENT_END = b"\n\n"
DONE_EVENT = b"data: [DONE]\n\n"
# An event longer than this is passed on in pieces as it comes rather than held whole (memory stays bounded).
MAX_HELD_BYTES = 16 * 1024 * 1024


class WholeEvents:
    """Lets only complete SSE events through: `cut()` returns the bytes up to the last event boundary seen so far
    and holds the incomplete event after it until its end arrives. The client's stream then always stops on a
    boundary, so an error event written after a broken upstream parses; `finish()` hands over what is held at a
    normal end of the stream, and a broken stream simply drops it. The bytes relayed are the upstream's, unchanged
    and in order; a chunk that ends on a boundary with nothing held passes through without a copy. `done`: the last
    whole event let through is `[DONE]`."""

    __slots__ = ("held", "held_bytes", "done")

    def __init__(self) -> None:
        self.held: list[bytes] = []
        self.held_bytes = 0
        self.done = False

    def cut(self, data: bytes) -> bytes:
        complete = self._cut(data)
        if complete:
            self.done = complete.endswith(DONE_EVENT)
        return complete

    def _cut(self, data: bytes) -> bytes:
        held = self.held
        if not held and data.endswith(EVENT_END):
            return data
        end = data.rfind(EVENT_END) + 2
        if end == 1 and not (held and held[-1].endswith(b"\n") and data.startswith(b"\n")):
            return self._hold(data)  # no boundary (one split across two chunks counts: it ends at data[1])
        complete = data[:end]
        if held:
            held.append(complete)
            complete = b"".join(held)
            held.clear()
            self.held_bytes = 0
        overflow = self._hold(data[end:])
        return complete + overflow if overflow else complete

    def finish(self) -> bytes:
        """What is held (an incomplete last event), at the stream's normal end."""
        rest = b"".join(self.held)
        self.held.clear()
        self.held_bytes = 0
        return rest

    def _hold(self, data: bytes) -> bytes:
        if data:
            self.held.append(data)
            self.held_bytes += len(data)
            if self.held_bytes > MAX_HELD_BYTES:
                return self.finish()
        return b""
