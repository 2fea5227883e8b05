"""The decode role's handoff phases that hold state of their own, each an object that enforces its invariant.

A PD request on the decode server goes, in order (its `Handoff.poll` says where; `PeerLink.handoffs` indexes every
room in flight; `decode.py` moves it):
  waiting for the bootstrap   BOOTSTRAPPING, its prefill's route unknown: `Routes` looks it up, once per address
  waiting for pages           BOOTSTRAPPING, route known: `DecodeRole._preallocate`, oldest first
  receiving                   WAITING_FOR_INPUT: page ids sent, until `kv_done` or the transfer deadline
  landed                      SUCCESS: `DecodeRole._commit` puts it in the scheduler's running batch
  fenced                      FAILED while the prefill may still write its pages: `Fence` holds them
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.disagg.control_messages import RouteResolved


class Routes:
    """The routes to prefill bootstrap servers, by address, as their lookups ended. Invariants (`need`): at most one
    lookup of an address is under way, and a route is reused until its lookup failed or its peer was declared dead;
    then the next request for that address looks it up again. Every rank holds the same routes (`resolved` runs as a
    step event on each); only the leader looks up (`started`)."""

    def __init__(self) -> None:
        self._known: dict[str, RouteResolved] = {}
        self._looking: set[str] = set()
        self._dead: set[str] = set()

    def need(self, addr: str) -> bool:
        """Whether `addr` must be looked up now: unknown, failed or dead, and no lookup of it under way."""
        if addr in self._dead or (addr in self._known and self._known[addr].error is not None):
            self._known.pop(addr, None)
            self._dead.discard(addr)
        return addr not in self._known and addr not in self._looking

    def started(self, addr: str) -> None:
        self._looking.add(addr)

    def resolved(self, msg: RouteResolved) -> None:
        self._looking.discard(msg.addr)
        self._known[msg.addr] = msg

    def peer_dead(self, addr: str) -> None:
        self._dead.add(addr)

    def get(self, addr: str) -> RouteResolved | None:
        """How the lookup of `addr` ended (None: not yet)."""
        return self._known.get(addr)


@dataclass(frozen=True, slots=True)
class FencedPages:
    pages: list[int]
    deadline: float  # the fence timeout: the pages come back then at the latest
    prefill: str  # the bootstrap address of the prefill that may still write them


class Fence:
    """The pages of failed handoffs that their prefill may still be writing, by room. Invariant: a fenced page goes
    back only through `release`, once its prefill confirmed (`failed` or `kv_done`), its process is gone, or the
    fence deadline passed; the caller frees what `release` returns."""

    def __init__(self) -> None:
        self._rooms: dict[int, FencedPages] = {}

    def hold(self, room: int, fenced: FencedPages) -> None:
        self._rooms[room] = fenced

    def release(self, room: int) -> list[int]:
        return self._rooms.pop(room).pages

    def rooms_of(self, prefill: str) -> list[int]:
        return [room for room, fenced in self._rooms.items() if fenced.prefill == prefill]

    def expired(self, now: float) -> list[int]:
        return [room for room, fenced in self._rooms.items() if now > fenced.deadline]

    def __contains__(self, room: int) -> bool:
        return room in self._rooms

    def __bool__(self) -> bool:
        return bool(self._rooms)
