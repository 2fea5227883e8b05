"""Typed messages between the server's processes, encoded with msgpack (never pickle).

A message is a frozen dataclass registered with `@message`; `encode` packs it as a map with a `__type__`
tag and `decode` rebuilds only registered classes, so a peer can never make us construct anything else.

Flow: tokenizer manager -> scheduler (generate, abort, control) -> detokenizer (decode settings, and the
scheduler's own TokenOut, the one shape of a step's output)
-> tokenizer manager (text). The scheduler answers control requests and refused requests directly to the
tokenizer manager; every child announces itself there with `ProcessReady`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import msgpack

_TYPE_KEY = "__type__"
_REGISTRY: dict[str, type] = {}


class MessageError(ValueError):
    """Bytes that are not a well-formed registered message."""


def message(cls: type) -> type:
    cls = dataclass(frozen=True, slots=True)(cls)
    _REGISTRY[cls.__name__] = cls
    return cls


def encode(msg: Any) -> bytes:
    if type(msg).__name__ not in _REGISTRY:
        raise MessageError(f"{type(msg).__name__} is not a registered message")
    return msgpack.packb(msg, default=_to_map, use_bin_type=True)


def decode(data: bytes) -> Any:
    try:
        msg = msgpack.unpackb(data, object_hook=_from_map, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise MessageError(f"undecodable message: {exc}") from exc
    if type(msg).__name__ not in _REGISTRY:
        raise MessageError(f"expected a message, got {type(msg).__name__}")
    return msg


def _to_map(obj: Any) -> dict:
    if type(obj).__name__ not in _REGISTRY:
        raise TypeError(f"cannot encode {type(obj).__name__}")
    out = {f.name: getattr(obj, f.name) for f in fields(obj)}
    out[_TYPE_KEY] = type(obj).__name__
    return out


def _from_map(data: dict) -> Any:
    tag = data.pop(_TYPE_KEY, None)
    if tag is None:
        return data
    cls = _REGISTRY.get(tag)
    if cls is None:
        raise MessageError(f"unknown message type {tag!r}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise MessageError(f"bad fields for {tag}: {exc}") from exc


# --- tokenizer manager -> scheduler ---------------------------------------------------------------


FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's marker: a PD request that moves no KV (health checks, warm-up)


@message
class TokenizedGenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: dict  # SamplingParams.to_dict(); the logprob settings are in it
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


@message
class AbortReq:
    rid: str


@message
class FlushCacheReq:
    request_id: int


@message
class GetStatsReq:
    request_id: int


@message
class SwitchRoleReq:
    """Become the PD role `mode` (prefill or decode) if idle (`POST /pd_role_switch`)."""

    request_id: int
    mode: str


# --- scheduler -> tokenizer manager ---------------------------------------------------------------


@message
class FlushCacheReply:
    request_id: int
    success: bool


@message
class GetStatsReply:
    request_id: int
    stats: dict


@message
class SwitchRoleReply:
    request_id: int
    success: bool
    message: str  # why the switch was refused or failed ('' on success)
    busy: bool  # refused because something is still in flight: worth asking again
    model_info: dict  # the scheduler's model info under the role it has now


@message
class RequestError:
    """The scheduler refused a request (e.g. too long); it never produces output."""

    rid: str
    message: str


@message
class ProcessReady:
    role: str  # "scheduler" | "detokenizer"
    info: dict = field(default_factory=dict)


# --- scheduler -> detokenizer ---------------------------------------------------------------------


@message
class DecodeSettings:
    """Sent once per accepted request, ahead of its first tokens on the same socket."""

    rid: str
    skip_special_tokens: bool
    stop: list[str]
    return_logprob: bool


@message
class TokenOut:
    rid: str
    new_token_ids: list[int]
    finish_reason: dict | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[list[list]] = field(default_factory=list)  # per token: [[token_id, logprob], ...]
    input_logprobs: list | None = None
    input_top_logprobs: list | None = None
    stage_marks: dict[str, float] | None = None  # the scheduler's timeline marks since the previous TokenOut


@message
class BatchTokenOut:
    outputs: list[TokenOut]


# --- detokenizer -> tokenizer manager -------------------------------------------------------------


@message
class StrOut:
    rid: str
    text: str  # new text since the previous StrOut of this request
    new_token_ids: list[int]
    finish_reason: dict | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_logprobs: list[list] = field(default_factory=list)  # per new token: [logprob, token_id, text]
    output_top_logprobs: list[list[list]] = field(default_factory=list)  # per new token: [[logprob, id, text], ...]
    input_logprobs: list | None = None  # raw from the scheduler; the tokenizer manager knows the prompt ids
    input_top_logprobs: list | None = None  # per prompt position: [[logprob, id, text], ...] or None
    stage_marks: dict[str, float] | None = None  # TokenOut's, passed on


@message
class BatchStrOut:
    outputs: list[StrOut]
