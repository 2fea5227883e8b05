"""Typed PD control messages: frozen slotted dataclasses checked field by field against their annotations.

On the wire a message is a msgpack map {"type": tag, field: value, ...}. `from_wire` rebuilds only registered
tags and refuses any field of the wrong type, so a handler never sees a malformed message. Messages a peer may
send are `remote`; the others (a KV write's result, a dead heartbeat target) are posted inside the process and
refused from the network.

  decode -> prefill  TransferRequest, StagingSlot, Abort
  prefill -> decode  StagingAsk, KVDone (FirstToken inside), Failed
  in-process         WriteDone, WriteFailed (the prefill's KV writer), PeerDead and PeerGone (the decode's heartbeat),
                     RouteResolved (the decode's bootstrap lookup)
"""

from __future__ import annotations

import functools
import math
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from pdserve.disagg.handoff import room_in_range

MAX_TOP_LOGPROBS = 1024
MAX_STRING = 4096


class ControlMessageError(ValueError):
    """A control message that is not a well-formed registered message."""


_REGISTRY: dict[str, type] = {}


def control(tag: str, remote: bool):
    def register(cls: type) -> type:
        cls = dataclass(frozen=True, slots=True)(cls)
        cls.tag, cls.remote = tag, remote
        _REGISTRY[tag] = cls
        return cls

    return register


class Message:
    """What every control message has: its wire tag and whether a peer may send it."""

    tag: ClassVar[str]
    remote: ClassVar[bool]


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The prefill's first sampled token and its logprobs; `kv_checksum` when the decode asked for one."""

    room: int
    first_token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    kv_checksum: int | None = None


@control("transfer_request", remote=True)
class TransferRequest(Message):
    """The decode claims a room: where its pages are and how to reach it."""

    room: int
    rid: str
    control: str  # the decode's control endpoint
    session: str  # the decode's transfer-engine session
    peer: dict  # the decode's peer description (checked by bootstrap.check_compatible)
    kv_base: int
    dst_pages: list[int]
    kv_checksum: bool = False
    cached_pages: int = 0  # leading pages of dst_pages the decode already holds: the prefill does not write them
    rank_targets: list[tuple[str, int]] = field(default_factory=list)  # see tp_targets
    staging_offered: bool = False  # a receive-staging slot is the prefill's for the asking (StagingAsk)


def tp_targets(msg: TransferRequest) -> list[tuple[str, int]]:
    """Every decode rank's (transfer session, KV base), in rank order: a decode with tensor parallelism lists
    them all in `rank_targets` (rank 0's also in `session` / `kv_base`); a single-rank decode needs no list."""
    return msg.rank_targets or [(msg.session, msg.kv_base)]


@control("staging_ask", remote=True)
class StagingAsk(Message):
    """The prefill starts computing the room: it asks for the receive-staging slot its decode offered."""

    room: int


@control("staging_slot", remote=True)
class StagingSlot(Message):
    """The decode's answer to `staging_ask`: each decode rank's slot address (`bases`, in rank order), of `num_pages`
    pages of KV (those of dst_pages after cached_pages); none (empty) when it stages nothing for the room."""

    room: int
    bases: list[int] = field(default_factory=list)
    num_pages: int = 0


@control("kv_done", remote=True)
class KVDone(Message):
    """The room's KV has landed, in its receive-staging slot (`staged`) or in its pages; the first token follows."""

    room: int
    rid: str
    aux: FirstToken
    staged: bool = False


@control("abort", remote=True)
class Abort(Message):
    """The decode gave the request up (`error`: why, so the client reads the same cause from either half). `status`:
    the decode's answer where the request itself was at fault (a 4xx, such as a grammar that does not compile), for
    the prefill to give the same."""

    room: int
    error: str | None = None
    status: int | None = None


@control("failed", remote=True)
class Failed(Message):
    """The prefill failed the request; no write for the room is in flight any more. `status`: the prefill's answer
    where the request itself was at fault (a 4xx, such as a grammar that does not compile), for the decode to give
    the same."""

    room: int
    error: str | None = None
    status: int | None = None


@control("write_done", remote=False)
class WriteDone(Message):
    """The prefill's writer finished `count` queued writes of the room: `nbytes` in `seconds`, the last of them
    landed at `landed_at` (time.monotonic() of the writer's host)."""

    room: int
    count: int
    nbytes: int = 0
    seconds: float = 0.0
    landed_at: float = 0.0


@control("write_failed", remote=False)
class WriteFailed(Message):
    """The prefill's writer could not write the room's KV."""

    room: int
    count: int
    error: str


@control("peer_dead", remote=False)
class PeerDead(Message):
    """The decode's heartbeat lost the prefill bootstrap server at `addr`."""

    addr: str


@control("peer_gone", remote=False)
class PeerGone(Message):
    """The dead prefill's bootstrap port at `addr` refuses connections: its process is gone, and its writes too."""

    addr: str


@control("route_resolved", remote=False)
class RouteResolved(Message):
    """The decode's lookup of the prefill's bootstrap route at `addr` ended: the route, or why it failed."""

    addr: str
    route: dict | None = None
    error: str | None = None


def to_wire(msg: Message) -> dict:
    out: dict[str, Any] = {"type": msg.tag}
    for f in fields(msg):
        value = getattr(msg, f.name)
        out[f.name] = {g.name: getattr(value, g.name) for g in fields(value)} if f.name == "aux" else value
    return out


def from_wire(data: object, remote: bool = True) -> Message:
    """The message `data` (a decoded msgpack map) stands for; raises ControlMessageError."""
    if not isinstance(data, dict):
        raise ControlMessageError(f"a control message is a map, got {type(data).__name__}")
    cls = _REGISTRY.get(data.get("type")) if isinstance(data.get("type"), str) else None
    if cls is None:
        raise ControlMessageError(f"unknown control message type {str(data.get('type'))[:64]!r}")
    if remote and not cls.remote:
        raise ControlMessageError(f"{cls.tag} is never accepted from a peer")
    return _build(cls, {k: v for k, v in data.items() if k != "type"})


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Any], frozenset[str]]:
    return typing.get_type_hints(cls), frozenset(f.name for f in fields(cls))


def _build(cls: type, data: dict) -> Any:
    hints, names = _schema(cls)
    unknown = set(data) - names
    if unknown:
        raise ControlMessageError(f"{cls.__name__}: unexpected fields {sorted(map(str, unknown))[:8]}")
    values = {}
    for name in names & set(data):
        values[name] = _checked(data[name], hints[name], f"{cls.__name__}.{name}")
    try:
        msg = cls(**values)
    except TypeError as exc:  # a required field is missing
        raise ControlMessageError(f"{cls.__name__}: {exc}") from exc
    room = getattr(msg, "room", 0)
    if not room_in_range(room):
        raise ControlMessageError(f"{cls.__name__}.room {room} is outside [0, 2^63)")
    return msg


def _checked(value: Any, hint: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        return _checked(value, next(a for a in args if a is not type(None)), where)
    if hint is FirstToken:
        if not isinstance(value, dict):
            raise ControlMessageError(f"{where} must be a map")
        return _checked_first_token(_build(FirstToken, value), where)
    if origin is list:
        if not isinstance(value, list):
            raise ControlMessageError(f"{where} must be a list")
        if args[0] is int and all(type(v) is int for v in value):  # page ids: the common case, checked at once
            return value
        return [_checked(v, args[0], f"{where}[]") for v in value]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ControlMessageError(f"{where} must be a list of {len(args)} items")
        return tuple(_checked(v, a, where) for v, a in zip(value, args))
    if hint is float:
        if type(value) not in (int, float) or not math.isfinite(value) and value != -math.inf:
            raise ControlMessageError(f"{where} must be a number")
        return float(value)
    if type(value) is not hint:  # bool is no int here, and int no bool
        raise ControlMessageError(f"{where} must be {hint.__name__}, got {type(value).__name__}")
    if hint is str and len(value) > MAX_STRING:
        raise ControlMessageError(f"{where} is longer than {MAX_STRING} characters")
    return value


def _checked_first_token(aux: FirstToken, where: str) -> FirstToken:
    if aux.top_logprobs is not None and len(aux.top_logprobs) > MAX_TOP_LOGPROBS:
        raise ControlMessageError(f"{where}.top_logprobs has more than {MAX_TOP_LOGPROBS} entries")
    return aux
