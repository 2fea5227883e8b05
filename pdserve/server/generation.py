"""What the native and the OpenAI routes share between parsing a body and answering: request checks, request ids,
logprob settings, and one request's output accumulated from its stream."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from pdserve.messages import FAKE_BOOTSTRAP_HOST
from pdserve.sampling_params import SamplingParamsError
from pdserve.server.http_common import ApiError
from pdserve.server.tokenizer_manager import Exchange, GenerateRequest, OutputDelta, TokenizerManager, merge_streams

request_logger = logging.getLogger("pdserve.requests")
LOGGED_TEXT_CHARS = 2048  # --log-requests-level 2 cuts texts here; 3 logs them whole


def sampling_error(exc: SamplingParamsError | TypeError) -> ApiError:
    return ApiError(400, f"invalid sampling parameters: {exc}")


ROLE_ALONE_NOTES = {  # meta_info entries of each answer of a role served alone (fake transfer backend)
    "prefill": {"kv": "fake: prompt KV handed to nobody",
                "output": "fake: the first token only, whatever max_new_tokens said"},
    "decode": {"kv": "fake: prompt KV not computed"},
}


def settle_bootstrap(args: Any, request: GenerateRequest) -> None:
    """A role served alone (`--disaggregation-transfer-backend fake`) takes every request as a fake-transfer one,
    whatever bootstrap fields it carries, and notes so in its answer. Otherwise a prefill server serves only
    requests the router paired up; a decode server also takes one without any bootstrap field and prefills it
    itself (conditional disaggregation); a colocated server ignores the fields."""
    if args.serves_role_alone:
        request.bootstrap_host, request.bootstrap_port, request.bootstrap_room = FAKE_BOOTSTRAP_HOST, None, 0
        request.meta_note = ROLE_ALONE_NOTES[args.disaggregation_mode]
        return
    fields = (request.bootstrap_host, request.bootstrap_room)
    local = args.disaggregation_mode == "decode" and fields == (None, None)
    if args.is_pd and not local and None in fields:
        raise ApiError(
            400,
            f"this is a PD {args.disaggregation_mode} server: requests need bootstrap_host and bootstrap_room "
            "(send them through the router)",
        )


def new_rid() -> str:
    return uuid.uuid4().hex


def with_logprobs(request: GenerateRequest, return_logprob: bool, top_n: int, start_len: int) -> GenerateRequest:
    params = request.sampling_params
    params.logprobs = top_n if return_logprob else None
    params.prompt_logprobs = top_n if return_logprob and start_len >= 0 else None
    params.logprob_start_len = start_len if return_logprob else -1
    return request


def check_batch_size(args: Any, size: int) -> None:
    if size == 0:
        raise ApiError(400, "the batch is empty")
    if size > args.max_batch_items:
        raise ApiError(400, f"batch of {size} prompts exceeds --max-batch-items {args.max_batch_items}")


def check_prompt_sizes(tm: TokenizerManager, prompts: list[str | list[int]]) -> None:
    """Each prompt fits the context by its length alone: characters of a text, ids of a token list."""
    for prompt in prompts:
        if isinstance(prompt, str):
            tm.check_prompt_chars(len(prompt))
        elif prompt is not None and len(prompt) > tm.context_length:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; the context holds {tm.context_length}")


def check_unique_rids(tm: TokenizerManager, requests: list[GenerateRequest]) -> None:
    rids = [r.rid for r in requests]
    if len(set(rids)) != len(rids):
        raise ApiError(400, "request ids in one batch must differ")
    tm.check_not_in_flight(rids)


# --- accumulating one request's output ------------------------------------------------------------


@dataclass(slots=True)
class Generation:
    """Everything one request has produced so far."""

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[list] = field(default_factory=list)
    output_top_logprobs: list[list] = field(default_factory=list)
    input_logprobs: list | None = None
    input_top_logprobs: list | None = None
    last: OutputDelta | None = None

    def add(self, delta: OutputDelta) -> None:
        out = delta.out
        self.text += out.text
        self.output_ids.extend(out.new_token_ids)
        self.output_logprobs.extend(out.output_logprobs)
        self.output_top_logprobs.extend(out.output_top_logprobs)
        if delta.input_logprobs is not None:
            self.input_logprobs = delta.input_logprobs
            self.input_top_logprobs = out.input_top_logprobs
        self.last = delta

    @property
    def finish_reason(self) -> dict | None:
        return self.last.out.finish_reason if self.last else None

    @property
    def prompt_tokens(self) -> int:
        return self.last.out.prompt_tokens if self.last else 0

    @property
    def completion_tokens(self) -> int:
        return self.last.out.completion_tokens if self.last else 0


async def collect(streams: list[AsyncIterator[OutputDelta]]) -> list[Generation]:
    generations = [Generation() for _ in streams]
    async with aclosing(merge_streams(streams)) as merged:
        async for index, delta in merged:
            generations[index].add(delta)
    return generations


# --- one request's output stream -----------------------------------------------------------------


def output_stream(tm: TokenizerManager, request: GenerateRequest, streamed: bool,
                  exchange: Exchange | None) -> AsyncIterator[OutputDelta]:
    """The request's outputs: logged with --log-requests and, when streamed, grouped by the request's
    stream_interval or else --stream-interval tokens; `exchange` is the HTTP exchange it came in (its timeline
    lives there)."""
    stream = tm.generate(request, exchange)
    if tm.args.log_requests:
        stream = _logged(stream, request, tm)
    interval = request.stream_interval or tm.args.stream_interval
    if streamed and interval > 1:
        stream = _every_n_tokens(stream, interval)
    return stream


def stream_interval_of(top_level: Any, nested: Any) -> int | None:
    """SGLang's per-request stream_interval (inside sampling_params, or beside it); None: the server's."""
    value = getattr(nested, "stream_interval", None)
    value = top_level.stream_interval if value is None else value
    if value is not None and value < 1:
        raise ApiError(400, f"stream_interval must be at least 1, got {value}")
    return value


async def _every_n_tokens(stream: AsyncIterator[OutputDelta], tokens: int) -> AsyncIterator[OutputDelta]:
    pending: OutputDelta | None = None
    async with aclosing(stream):
        async for delta in stream:
            pending = delta if pending is None else _joined(pending, delta)
            if pending.finished or len(pending.out.new_token_ids) >= tokens:
                yield pending
                pending = None


def _joined(earlier: OutputDelta, later: OutputDelta) -> OutputDelta:
    a, b = earlier.out, later.out
    out = dataclasses.replace(
        b, text=a.text + b.text, new_token_ids=a.new_token_ids + b.new_token_ids,
        output_logprobs=a.output_logprobs + b.output_logprobs,
        output_top_logprobs=a.output_top_logprobs + b.output_top_logprobs,
        input_logprobs=a.input_logprobs if a.input_logprobs is not None else b.input_logprobs,
        input_top_logprobs=a.input_top_logprobs if a.input_top_logprobs is not None else b.input_top_logprobs,
    )
    input_logprobs = earlier.input_logprobs if earlier.input_logprobs is not None else later.input_logprobs
    ttft = earlier.ttft if earlier.ttft is not None else later.ttft
    return OutputDelta(out, input_logprobs, ttft, later.e2e_latency)


async def _logged(stream: AsyncIterator[OutputDelta], request: GenerateRequest,
                  tm: TokenizerManager) -> AsyncIterator[OutputDelta]:
    level = tm.args.log_requests_level
    prompt = _logged_text(tm.tokenizer.decode(request.input_ids), level) if level >= 2 else ""
    request_logger.info("request %s: %d prompt tokens%s", request.rid, len(request.input_ids), prompt)
    generation = Generation()
    async with aclosing(stream):
        async for delta in stream:
            generation.add(delta)
            yield delta
    output = _logged_text(generation.text, level) if level >= 2 else ""
    request_logger.info("request %s finished (%s): %d output tokens%s", request.rid,
                        (generation.finish_reason or {}).get("type"), generation.completion_tokens, output)


def _logged_text(text: str, level: int) -> str:
    return f": {(text if level >= 3 else text[:LOGGED_TEXT_CHARS])!r}"
