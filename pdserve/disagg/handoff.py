"""The PD handoff protocol both roles and the HTTP server agree on: states, error statuses, input checks.

Torch-free, so the HTTP server imports it without loading the engine.

Control messages (typed, see control_messages; keyed by `bootstrap_room`):
  decode -> prefill  transfer_request {room, rid, control, session, peer, kv_base, dst_pages, kv_checksum,
                                       cached_pages, rank_targets, staging_offered}
  prefill -> decode  staging_ask {room}  (once its computing begins, if a receive-staging slot was offered)
  decode -> prefill  staging_slot {room, bases, num_pages}  (the slot, or none)
  prefill -> decode  kv_done {room, rid, aux: {room, first_token, logprob, top_logprobs, kv_checksum}, staged}
  decode -> prefill  abort {room, error, status}  (also for a request the prefill has not received yet)
  prefill -> decode  failed {room, error, status}  (sent once no write for the room is in flight any more)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

from pdserve.messages import FAKE_BOOTSTRAP_HOST

if TYPE_CHECKING:
    from pdserve.disagg.transfer.base import KVTarget
    from pdserve.scheduler.request import Req

MAX_PAGES_PER_MESSAGE = 1 << 20
NUM_ROOMS = 2**63  # bootstrap rooms are 63-bit, as in SGLang
PEER_FAILED = 502  # HTTP status of a request whose handoff failed at or with the peer (the router may retry it)
PEER_TIMEOUT = 504  # ... or timed out waiting for the peer


class KVPoll(IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


@dataclass(slots=True, eq=False)
class Handoff:
    """One request's KV handoff on either side. The state only moves forward; FAILED dominates."""

    req: Req
    room: int
    deadline: float
    poll: KVPoll = KVPoll.BOOTSTRAPPING
    error: str | None = None
    peer_control: str | None = None  # the other side's control endpoint
    peer_targets: list[KVTarget] = field(default_factory=list)  # prefill: each decode rank it writes into
    dst_pages: list[int] = field(default_factory=list)
    pages_computed: int = 0  # prefill: leading pages whose KV is computed (sent once the page list is known)
    prefilled: bool = False  # prefill: the prompt is computed and its first token sampled
    pages_sent: int = 0
    writes_in_flight: int = 0
    kv_checksum: bool = False  # the decode asked for a checksum of the pages with the first token
    write_seconds: float = 0.0  # prefill: time its KV writes took so far
    writes_landed_at: float = 0.0  # prefill: time.monotonic() when its latest write landed
    pages_sent_at: float | None = None  # decode: when the page ids went to the prefill
    cached_pages: int = 0  # leading pages the decode side already held (its radix cache): never transferred

    def advance(self, state: KVPoll, error: str | None = None) -> None:
        if self.poll == KVPoll.FAILED:
            return
        if state == KVPoll.FAILED:
            self.poll, self.error = KVPoll.FAILED, error
        elif state > self.poll:
            self.poll = state


def peer_status(status: int | None) -> int:
    """The HTTP status of a half whose peer failed the request: the peer's own 4xx (the request itself was at fault,
    so both halves answer the same), else PEER_FAILED (a status from another process is never taken on trust)."""
    return status if status is not None and 400 <= status < 500 else PEER_FAILED


def checked_pages(value, limit: int, expected: int) -> list[int]:
    """Page ids from another process: a list of `expected` distinct ints in [1, limit)."""
    if not isinstance(value, list) or len(value) != expected or expected > MAX_PAGES_PER_MESSAGE:
        raise ValueError(f"expected {expected} destination pages, got {type(value).__name__} of "
                         f"{len(value) if isinstance(value, list) else '?'}")
    if not all(type(p) is int and 1 <= p < limit for p in value) or len(set(value)) != len(value):
        raise ValueError(f"destination pages must be distinct ints in [1, {limit})")
    return value


def checked_cached_pages(value: int, prompt_len: int, page_size: int) -> int:
    """The decode's count of leading pages it already holds: full pages only, and never the page of the last
    prompt token (its KV always travels with the first token)."""
    if not 0 <= value <= (prompt_len - 1) // page_size:
        raise ValueError(f"cached_pages {value} is outside [0, {(prompt_len - 1) // page_size}] for a prompt of "
                         f"{prompt_len} tokens")
    return value


def is_local_prefill(req: Req) -> bool:
    """A request without any bootstrap field: a decode server prefills it itself (conditional disaggregation)."""
    return req.bootstrap_host is None and req.bootstrap_port is None and req.bootstrap_room is None


def validate_pd_request(req: Req, handoffs: dict[int, Handoff], allow_local: bool = False) -> None:
    """A decode server (`allow_local`) prefills a request without bootstrap fields itself, as colocated; every
    other request is half of a KV handoff, which needs a first token to hand over."""
    if allow_local and is_local_prefill(req):
        return
    if req.sampling_params.max_tokens < 1:
        raise ValueError("max_new_tokens 0 has no KV handoff: send it to a decode server without bootstrap fields "
                         "(the router does)")
    if req.bootstrap_host == FAKE_BOOTSTRAP_HOST:
        return
    if req.bootstrap_room is None or req.bootstrap_host is None or req.bootstrap_port is None:
        raise ValueError("this is a PD server: requests need bootstrap_host, bootstrap_port and bootstrap_room "
                         "(send them through the router)")
    if not room_in_range(req.bootstrap_room):
        raise ValueError(f"bootstrap_room must be in [0, 2^63), got {req.bootstrap_room}")
    if req.bootstrap_room in handoffs:
        raise ValueError(f"bootstrap_room {req.bootstrap_room} is already in use")


def room_in_range(room: int) -> bool:
    """The one check of a room's range, for a client's request and a peer's control message alike."""
    return 0 <= room < NUM_ROOMS


def now() -> float:
    return time.monotonic()
