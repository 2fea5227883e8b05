"""One streamed request against a serving endpoint, timed the way SGLang's bench_serving times it.

Backends: `pdserve` and `sglang` (native `/generate`, token counts from `meta_info.completion_tokens`),
`openai` (`/v1/completions`) and `openai-chat` (`/v1/chat/completions`; one SSE chunk counts as one token,
the final usage chunk gives the true count). A chunk that brings k tokens adds k inter-token latencies of
gap / k each.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdserve.bench.datasets import BenchRequest

BACKENDS = ("pdserve", "sglang", "openai", "openai-chat")
ERROR_TEXT_LIMIT = 300


@dataclass(frozen=True, slots=True)
class ClientConfig:
    backend: str
    base_url: str
    model: str | None = None
    ignore_eos: bool = True
    min_tokens: bool = False  # also send min_(new_)tokens = output_len (slower on engines that sync on it)
    api_key: str | None = None
    timeout_s: float = 600.0
    extra_body: dict = field(default_factory=dict)


@dataclass(slots=True)
class RequestResult:
    """What one request measured; times in seconds, `start_s` relative to the run's start."""

    input_len: int
    expected_output_len: int
    start_s: float = 0.0
    success: bool = False
    aborted: bool = False  # the client disconnected on purpose (soak); neither success nor error
    error: str = ""
    prompt_tokens: int | None = None  # as the server reported them
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1): SGLang's per-request TPOT; undefined for a single token."""
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def request_body(config: ClientConfig, request: BenchRequest) -> tuple[str, dict]:
    """The route and JSON body for `request` on `config.backend`."""
    eos = {"ignore_eos": True} if config.ignore_eos else {}
    if config.backend in ("pdserve", "sglang"):
        params = {"max_new_tokens": request.output_len, "temperature": 0.0, **eos}
        if config.min_tokens:
            params["min_new_tokens"] = request.output_len
        return "/generate", merge_extra_body({"text": request.prompt, "sampling_params": params, "stream": True},
                                             config.extra_body)
    common = {"model": config.model, "max_tokens": request.output_len, "temperature": 0.0, "stream": True,
              "stream_options": {"include_usage": True}, **eos,
              **({"min_tokens": request.output_len} if config.min_tokens else {}), **config.extra_body}
    if config.backend == "openai":
        return "/v1/completions", {"prompt": request.prompt, **common}
    if config.backend == "openai-chat":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": request.prompt}], **common}
    raise ValueError(f"unknown backend {config.backend!r}; one of {', '.join(BACKENDS)}")


def merge_extra_body(body: dict, extra: dict) -> dict:
    """`extra` over `body`, key by key, except that a `sampling_params` dict in both merges into the body's."""
    merged = {**body, **extra}
    if isinstance(body.get("sampling_params"), dict) and isinstance(extra.get("sampling_params"), dict):
        merged["sampling_params"] = {**body["sampling_params"], **extra["sampling_params"]}
    return merged


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict | None]:
    """The JSON payloads of an SSE stream; None for `[DONE]`."""
    async for line in response.content:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        yield None if data == b"[DONE]" else json.loads(data)


class TokenClock:
    """Turns arrival times of token counts into TTFT, ITL and E2E."""

    def __init__(self, result: RequestResult, sent_at: float):
        self.result = result
        self.sent_at = sent_at
        self.last = sent_at

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.perf_counter()
        if self.result.output_len == 0:
            self.result.ttft = now - self.sent_at
        else:
            self.result.itl.extend([(now - self.last) / count] * count)
        self.result.output_len += count
        self.last = now


def new_tokens(backend: str, event: dict, seen: int) -> int:
    """How many tokens `event` adds to the `seen` so far."""
    if backend in ("pdserve", "sglang"):
        return event.get("meta_info", {}).get("completion_tokens", seen) - seen
    choices = event.get("choices") or []
    if not choices:
        return 0
    text = choices[0].get("text") if backend == "openai" else (choices[0].get("delta") or {}).get("content")
    return 1 if text else 0


async def send(session: aiohttp.ClientSession, config: ClientConfig, request: BenchRequest,
               abort_after_tokens: int | None = None) -> RequestResult:
    """Stream one request; every failure ends in `error`, never an exception. With `abort_after_tokens`, the
    client disconnects once that many tokens have arrived."""
    result = RequestResult(request.input_len, request.output_len)
    route, body = request_body(config, request)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    clock = TokenClock(result, time.perf_counter())
    try:
        async with session.post(config.base_url + route, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=config.timeout_s)) as response:
            if response.status != 200:
                text = await response.text(errors="replace")
                result.error = f"HTTP {response.status}: {error_message(text)}"[:ERROR_TEXT_LIMIT]
                return result
            await _consume(response, config.backend, clock, abort_after_tokens)
    except asyncio.TimeoutError:
        result.error = f"timeout after {config.timeout_s:g} s"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:ERROR_TEXT_LIMIT]
    result.latency = clock.last - clock.sent_at
    return result


def error_message(body: str) -> str:
    """The message of a JSON error body (`{"error": {"message": ...}}` or `{"error": "..."}`), else the body."""
    try:
        error = json.loads(body).get("error", body)
    except (ValueError, AttributeError):
        return body.strip()
    return str(error.get("message", error) if isinstance(error, dict) else error)


async def _consume(response: aiohttp.ClientResponse, backend: str, clock: TokenClock,
                   abort_after_tokens: int | None) -> None:
    result = clock.result
    async for event in sse_events(response):
        if event is None:
            result.success = True
            return
        if "error" in event:
            error = event["error"]
            result.error = "in-band: " + str(error.get("message", error) if isinstance(error, dict) else error)
            return
        clock.tokens(new_tokens(backend, event, result.output_len))
        _read_usage(backend, event, result)
        if abort_after_tokens is not None and result.output_len >= abort_after_tokens:
            response.close()
            result.aborted = True
            return
    result.error = "the stream ended without [DONE]"


def _read_usage(backend: str, event: dict, result: RequestResult) -> None:
    if backend in ("pdserve", "sglang"):
        result.prompt_tokens = event.get("meta_info", {}).get("prompt_tokens", result.prompt_tokens)
    elif usage := event.get("usage"):
        result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
        # the true count where chunks were counted one token each
        result.output_len = usage.get("completion_tokens", result.output_len)


def as_record(result: RequestResult) -> dict[str, Any]:
    return {name: getattr(result, name) for name in RequestResult.__slots__} | {"tpot": result.tpot}
