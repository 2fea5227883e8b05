"""The decode role's handoff phases that hold state of their own, each an object that enforces its invariant.

A PD request on the decode server goes, in order (its `Handoff.poll` says where; `PeerLink.handoffs` indexes every
room in flight; `decode.py` moves it):
  waiting for the bootstrap   BOOTSTRAPPING, its prefill's route unknown: `Routes` looks it up, once per address
  waiting for pages           BOOTSTRAPPING, route known: `WaitingForPages`, in arrival order
  receiving                   WAITING_FOR_INPUT: page ids sent, until `kv_done` or the transfer deadline; its
                              receive-staging slot, if offered, is given when its prefill asks and the arena has
                              room (`ReceiveStaging`)
  landed                      SUCCESS: `DecodeRole._commit` puts it in the scheduler's running batch
  fenced                      FAILED while the prefill may still write its pages: `Fence` holds them
A fake-transfer request (no prefill peer) only waits for pages, then lands. A request refused before its handoff
began waits with `Routes` for its prefill's route, to tell it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.disagg.control_messages import Abort, RouteResolved
from pdserve.disagg.early_requests import ExpiringRooms
from pdserve.disagg.handoff import Handoff

if TYPE_CHECKING:
    from pdserve.scheduler.request import Req


class Routes:
    """The routes to prefill bootstrap servers, by address, as their lookups ended. Invariants (`need`): at most one
    lookup of an address is under way, and a route is reused until its lookup failed or its peer was declared dead;
    then the next request for that address looks it up again. Every rank holds the same routes (`resolved` runs as a
    step event on each); only the leader looks up (`started`). Refusals wait here for the route of the prefill they
    are for (`refuse_when_known`): taken once its lookup ended (`refusals_due`), dropped after `refusal_ttl_s`."""

    def __init__(self, refusal_ttl_s: float) -> None:
        self._known: dict[str, RouteResolved] = {}
        self._looking: set[str] = set()
        self._dead: set[str] = set()
        self._refusals: ExpiringRooms[tuple[str, Abort]] = ExpiringRooms(refusal_ttl_s)  # room -> (addr, abort)

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

    def refuse_when_known(self, addr: str, abort: Abort, now: float) -> None:
        self._refusals.put(abort.room, (addr, abort), now)

    def refusals_due(self, addr: str) -> list[Abort]:
        """The refusals for `addr`'s prefill, taken, once its lookup ended (none before)."""
        if addr not in self._known:
            return []
        due = [(room, abort) for room, (refused_addr, abort) in self._refusals.items() if refused_addr == addr]
        for room, _ in due:
            self._refusals.take(room)
        return [abort for _, abort in due]

    def expire_refusals(self, now: float) -> None:
        self._refusals.expire(now)

    def num_refusals(self) -> int:
        return len(self._refusals)


class WaitingForPages:
    """Waiting for pages: the requests that lack only their destination pages, the fake-transfer ones (held here)
    and the handoffs whose prefill's route is known (in `PeerLink.handoffs`). Invariants, enforced by `serve`: they
    take pages in arrival order, the fake-transfer ones first, and none past one that does not fit; after one did
    not fit, no step is asked for them (`may_fit`) until the pages available changed."""

    def __init__(self, routes: Routes) -> None:
        self._routes = routes
        self._fake: deque[Handoff] = deque()
        self._free_when_blocked: int | None = None  # pages available when one last did not fit

    def add_fake(self, h: Handoff) -> None:
        self._fake.append(h)

    def has_fake(self) -> bool:
        return bool(self._fake)

    def ready(self, bootstrapping: list[Handoff]) -> list[Handoff]:
        """The handoffs of `bootstrapping` (oldest first) whose route is known."""
        return [h for h in bootstrapping if self._routes.get(bootstrap_addr(h.req)) is not None]

    def may_fit(self, available: int, bootstrapping: list[Handoff]) -> bool:
        """Some request waits, and pages may have been freed since one last did not fit."""
        return self._free_when_blocked != available and (bool(self._fake) or bool(self.ready(bootstrapping)))

    def serve(self, bootstrapping: list[Handoff], reserved: int, take: Callable[[Handoff, int], int | None],
              available: Callable[[], int]) -> None:
        """Offer each waiting request, in order, to `take(h, reserved)`, which gives h its pages next to `reserved`
        pages held back for others' growth and returns the pages it holds back for h's (0 when h left otherwise),
        or None when they do not fit: then the pass stops there. A fake-transfer request aborted while it waited
        leaves unoffered."""
        self._free_when_blocked = None
        for h in [*self._fake, *self.ready(bootstrapping)]:
            held = 0 if h.req.finished else take(h, reserved)
            if held is None:
                self._free_when_blocked = available()
                return
            if self._fake and h is self._fake[0]:
                self._fake.popleft()
            reserved += held


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


def bootstrap_addr(req: Req) -> str:
    """The `host:port` of req's prefill bootstrap server, as `Routes` keys it."""
    host = req.bootstrap_host
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{host}:{req.bootstrap_port}"
