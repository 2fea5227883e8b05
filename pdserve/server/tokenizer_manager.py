"""Tokenizer manager: the HTTP process's side of the engine (asyncio).

It tokenizes prompts (and renders chat templates), checks them against the model, sends them to the
scheduler, and routes the detokenizer's text back to the waiting request by rid. Metrics are recorded
here, where every request's first and last output is seen.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from pdserve.sampling_params import PromptError, SamplingParams, check_prompt
from pdserve.ipc import ipc_addr, pull_socket, push_socket
from pdserve.messages import (
    FAKE_BOOTSTRAP_HOST,
    AbortReq,
    BatchStrOut,
    FlushCacheReply,
    FlushCacheReq,
    GetStatsReply,
    GetStatsReq,
    MessageError,
    ProcessReady,
    RequestError,
    StrOut,
    SwitchRoleReply,
    SwitchRoleReq,
    TokenizedGenerateReq,
    decode,
    encode,
)
from pdserve.server.metrics import ServerMetrics
from pdserve.server.prefix_digest import PrefixDigest
from pdserve.tokenizer import TokenBytes
from pdserve.timeline import DETOKENIZED, SENT, TOKENIZED, Arrival, RequestTimeline, TimelineSink, server_role

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_SECONDS = 30.0
SWITCH_TIMEOUT_SECONDS = 1800.0  # a role switch warms the new role up (first compiles of its kernels)


class RequestRejected(Exception):
    """A request the server cannot serve; the HTTP layer answers `status` with `message`."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(slots=True)
class GenerateRequest:
    """One prompt, tokenized and validated, ready for the scheduler."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    routing_key: str | list[int] | None = None  # what the router hashes for cache-aware routing (prefix_digest)
    meta_note: dict = field(default_factory=dict)  # entries added to the answer's meta_info (a role served alone)
    stream_interval: int | None = None  # SGLang's per-request streaming cadence; None: the server's --stream-interval


@dataclass(slots=True)
class OutputDelta:
    """New output of one request, as the detokenizer sent it, plus timing."""

    out: StrOut
    input_logprobs: list | None  # [[logprob, token_id, text], ...], first delta only, when asked
    ttft: float | None
    e2e_latency: float

    @property
    def finished(self) -> bool:
        return self.out.finish_reason is not None


@dataclass(slots=True)
class Exchange:
    """One HTTP request and the timelines of the generation requests it made: they start at its arrival and end
    once its answer has started (or it failed), so SENT is theirs too."""

    arrival: Arrival = field(default_factory=Arrival.now)
    timelines: list[RequestTimeline] = field(default_factory=list)

    def answer_started(self) -> None:
        for timeline in self.timelines:
            timeline.mark(SENT)


@dataclass(slots=True)
class ReqState:
    request: GenerateRequest
    timeline: RequestTimeline | None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None


class TokenizerManager:
    def __init__(self, args: Any, metrics: ServerMetrics, tokenizer: Any):
        self.args = args
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.token_bytes = TokenBytes(tokenizer)
        # Tokenization runs on its own thread (the Rust tokenizer releases the GIL), so a big prompt or batch
        # never stalls the event loop; one thread, so the tokenizer is never used by two at once.
        self._tokenize_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._longest_token_chars = max(map(len, tokenizer.get_vocab()), default=1)
        self.model_info: dict = {}
        self.states: dict[str, ReqState] = {}
        self.role = server_role(args.disaggregation_mode)
        self.timeline_sink = TimelineSink(metrics.registry, args.request_timeline_log)
        self.prefix_digest = PrefixDigest(args.keeps_prefix_cache)
        self._control_ids = itertools.count()
        self._control_waiters: dict[int, asyncio.Future] = {}
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        # A plain socket for sending: sends never block (unbounded queue) and work inside `finally`.
        self._to_scheduler = push_socket(self._sync_ctx, ipc_addr(args, "scheduler"))
        self._receiver = pull_socket(self._async_ctx, ipc_addr(args, "tokenizer"), bind=True)
        self._recv_task: asyncio.Task | None = None
        self._ended: RequestRejected | None = None  # set at shutdown: every request then fails with it

    # --- lifecycle -----------------------------------------------------------------------------

    async def wait_ready(self, roles: set[str], timeout: float) -> None:
        """Wait for every child's `ProcessReady`."""
        deadline = time.monotonic() + timeout
        pending = set(roles)
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{', '.join(sorted(pending))} not ready after {timeout:.0f} s")
            if not await self._receiver.poll(500):
                continue
            msg = decode(await self._receiver.recv())
            if isinstance(msg, ProcessReady):
                pending.discard(msg.role)
                if msg.role == "scheduler":
                    self.model_info = dict(msg.info)
                logger.info("%s ready", msg.role)

    def start(self) -> None:
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop(), name="tokenizer-recv")

    def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
        self._to_scheduler.close(linger=0)
        self._receiver.close(linger=0)
        self._sync_ctx.term()
        self._async_ctx.term()
        self._tokenize_thread.shutdown(wait=False, cancel_futures=True)
        self.timeline_sink.close()

    # --- model facts ---------------------------------------------------------------------------

    @property
    def context_length(self) -> int:
        return int(self.model_info["max_context_len"])

    @property
    def vocab_size(self) -> int:
        return int(self.model_info["vocab_size"])

    # --- tokenization --------------------------------------------------------------------------

    @property
    def max_prompt_chars(self) -> int:
        """Characters past which a prompt cannot fit the context: no token spans more characters than the
        vocabulary's longest entry, so a longer text has more tokens than the context holds."""
        return self.context_length * self._longest_token_chars

    def check_prompt_chars(self, chars: int) -> None:
        """Refuse, before tokenizing it, a prompt too long for the context whatever its tokens."""
        if chars > self.max_prompt_chars:
            raise RequestRejected(
                f"the prompt has {chars} characters; the context of {self.context_length} tokens holds at most "
                f"{self.max_prompt_chars} with this tokenizer"
            )

    async def encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Token ids of each prompt (text is tokenized, ids are kept), off the event loop."""
        return await self._off_loop(lambda: [self.tokenize(p) if isinstance(p, str) else list(p) for p in prompts])

    async def check_requests(self, requests: list[GenerateRequest]) -> None:
        """`check_prompt` for each request, off the event loop: it reads every token id."""
        await self._off_loop(lambda: [self.check_prompt(r.input_ids, r.sampling_params) for r in requests])

    async def encode_chat(self, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
        self.check_prompt_chars(sum(len(m["content"]) for m in messages))
        return await self._off_loop(lambda: self.apply_chat_template(messages, template_kwargs))

    async def _off_loop(self, work: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_thread, work)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def apply_chat_template(self, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
        if not messages:
            raise RequestRejected("messages is empty")
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestRejected("this model's tokenizer has no chat template; use /v1/completions")
        try:
            prompt = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
            )
        except Exception as exc:  # a template error is the request's fault (bad roles, bad kwargs)
            raise RequestRejected(f"cannot apply the chat template: {exc}") from exc
        return list(self.tokenizer.encode(prompt, add_special_tokens=False))

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_prompt(self, input_ids: list[int], params: SamplingParams) -> None:
        """Reject prompts the model cannot take and limits past the context; clamp max_tokens to the room left."""
        if params.max_tokens > self.context_length:
            raise RequestRejected(
                f"max tokens ({params.max_tokens}) exceeds the context length ({self.context_length})"
            )
        try:
            check_prompt(input_ids, params, self.vocab_size, self.context_length)
        except PromptError as exc:
            raise RequestRejected(str(exc)) from exc

    # --- requests ------------------------------------------------------------------------------

    def check_not_in_flight(self, rids: Iterable[str]) -> None:
        """The server's one check that request ids are free: a batch is refused whole before any item is sent,
        and `generate` checks again as it registers the request."""
        for rid in rids:
            if rid in self.states:
                raise RequestRejected(f"request id {rid!r} is already in flight")

    async def generate(self, request: GenerateRequest, exchange: Exchange | None = None) -> AsyncIterator[OutputDelta]:
        """Submit one request and yield its outputs; leaving early (disconnect, cancel) aborts it. With the HTTP
        `exchange` it came in (none for a health probe), its timeline is kept there until `finish_timelines`."""
        if self._ended is not None:
            raise self._ended
        self.check_not_in_flight([request.rid])
        message = encode(_tokenized(request))
        state = ReqState(request, self._begin_timeline(request.rid, exchange))
        self.states[request.rid] = state
        self.metrics.request_started()
        self._to_scheduler.send(message)
        finished = False
        try:
            while not finished:
                item = await state.queue.get()
                if isinstance(item, RequestRejected):
                    raise item
                if isinstance(item, RequestError):
                    finished = True
                    raise RequestRejected(item.message)
                finished = item.finish_reason is not None
                if finished and item.finish_reason.get("status_code"):  # the server failed it (e.g. a PD handoff)
                    failure = item.finish_reason
                    raise RequestRejected(failure.get("message") or "the request failed", failure["status_code"])
                if finished and item.finish_reason.get("type") != "abort" and self._computed_kv(request):
                    self.prefix_digest.record(request.routing_key, len(request.input_ids))
                yield self._delta(state, item)
        finally:
            if not finished:
                self.abort(request.rid)

    def _begin_timeline(self, rid: str, exchange: Exchange | None) -> RequestTimeline | None:
        if exchange is None:
            return None
        timeline = RequestTimeline.begin(rid, self.role, exchange.arrival)
        timeline.mark(TOKENIZED)  # its prompt was tokenized and checked: it goes to the scheduler now
        exchange.timelines.append(timeline)
        return timeline

    def finish_timelines(self, exchange: Exchange) -> None:
        """The exchange's answer was started, failed or abandoned: its requests' timelines are recorded."""
        for timeline in exchange.timelines:
            self.timeline_sink.finish(timeline)
        exchange.timelines.clear()

    def _computed_kv(self, request: GenerateRequest) -> bool:
        """Whether the request's prompt KV was computed here or received (a decode server's fake-transfer request
        has neither, and never enters its prefix cache)."""
        return self.args.disaggregation_mode != "decode" or request.bootstrap_host != FAKE_BOOTSTRAP_HOST

    def _delta(self, state: ReqState, out: StrOut) -> OutputDelta:
        now = time.perf_counter()
        ttft = None if state.first_token_time is None else state.first_token_time - state.created
        input_logprobs = None
        if out.input_logprobs is not None:
            input_logprobs = self._input_logprob_entries(state.request, out.input_logprobs)
        return OutputDelta(out, input_logprobs, ttft, now - state.created)

    def _input_logprob_entries(self, request: GenerateRequest, logprobs: list) -> list:
        start = max(request.sampling_params.first_prompt_logprob, 0)
        ids = request.input_ids[start : start + len(logprobs)]
        return [[lp, token_id, self.decode_token(token_id)] for lp, token_id in zip(logprobs, ids)]

    def abort(self, rid: str) -> bool:
        if rid not in self.states:
            return False
        self._to_scheduler.send(encode(AbortReq(rid)))
        return True

    def end_all(self, reason: RequestRejected) -> None:
        """Fail every request in flight with `reason` (and abort it in the scheduler), and every later one."""
        self._ended = reason
        for state in self.states.values():
            state.queue.put_nowait(reason)

    def abort_all(self) -> int:
        rids = list(self.states)
        for rid in rids:
            self.abort(rid)
        return len(rids)

    # --- control -------------------------------------------------------------------------------

    async def flush_cache(self) -> bool:
        reply = await self._control(FlushCacheReq)
        if reply.success:
            self.prefix_digest.clear()
        return reply.success

    async def get_stats(self) -> dict:
        reply = await self._control(GetStatsReq)
        return reply.stats

    async def switch_role(self, mode: str) -> SwitchRoleReply:
        """Ask the scheduler to take the PD role `mode`; on success this side serves as that role from now on."""
        reply = await self._control(SwitchRoleReq, mode, timeout=SWITCH_TIMEOUT_SECONDS)
        if reply.success:
            self.args = self.args.replace(disaggregation_mode=mode)
            self.role = server_role(mode)
            self.model_info = {**reply.model_info, "warmup": self.model_info.get("warmup")}  # the start's warm-up
            self.prefix_digest = PrefixDigest(self.args.keeps_prefix_cache)  # the new role's cache starts empty
        return reply

    async def _control(self, message_class: type, *fields: Any, timeout: float = CONTROL_TIMEOUT_SECONDS) -> Any:
        request_id = next(self._control_ids)
        waiter = asyncio.get_running_loop().create_future()
        self._control_waiters[request_id] = waiter
        try:
            self._to_scheduler.send(encode(message_class(request_id, *fields)))
            return await asyncio.wait_for(waiter, timeout)
        finally:
            self._control_waiters.pop(request_id, None)

    # --- receiving -----------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        while True:
            data = await self._receiver.recv()
            try:
                msg = decode(data)
            except MessageError as exc:
                logger.error("dropped a malformed message: %s", exc)
                continue
            if isinstance(msg, BatchStrOut):
                self._on_outputs(msg)
            elif isinstance(msg, RequestError):
                self._on_request_error(msg)
            elif isinstance(msg, (FlushCacheReply, GetStatsReply, SwitchRoleReply)):
                waiter = self._control_waiters.get(msg.request_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(msg)
            else:
                logger.warning("unexpected message %s", type(msg).__name__)

    def _on_outputs(self, batch: BatchStrOut) -> None:
        now = time.perf_counter()
        for out in batch.outputs:
            state = self.states.get(out.rid)
            if state is None:
                continue
            self._record_timing(state, out, now)
            if state.timeline is not None:
                _mark_output(state.timeline, out)
            state.queue.put_nowait(out)
            if out.finish_reason is not None:
                del self.states[out.rid]
                self.metrics.request_finished(out, now - state.created)

    def _record_timing(self, state: ReqState, out: StrOut, now: float) -> None:
        count = len(out.new_token_ids)
        if count == 0:
            return
        if state.first_token_time is None:
            state.first_token_time = now
            self.metrics.observe_ttft(now - state.created)
            count -= 1
        if count and state.last_token_time is not None:
            self.metrics.observe_inter_token((now - state.last_token_time) / count, count)
        state.last_token_time = now

    def _on_request_error(self, msg: RequestError) -> None:
        state = self.states.pop(msg.rid, None)
        if state is not None:
            self.metrics.request_rejected()
            state.queue.put_nowait(msg)


def _mark_output(timeline: RequestTimeline, out: StrOut) -> None:
    """DETOKENIZED, and the scheduler's marks (its time.monotonic(): this host's clock, as ours)."""
    if out.stage_marks:
        timeline.merge(out.stage_marks)
    timeline.mark(DETOKENIZED)


def _tokenized(request: GenerateRequest) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(
        rid=request.rid,
        input_ids=request.input_ids,
        sampling_params=request.sampling_params.to_dict(),
        bootstrap_host=request.bootstrap_host,
        bootstrap_port=request.bootstrap_port,
        bootstrap_room=request.bootstrap_room,
    )


async def merge_streams(streams: list[AsyncIterator[OutputDelta]]) -> AsyncIterator[tuple[int, OutputDelta]]:
    """Interleave several requests' outputs as they arrive, tagged with the stream's index."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[OutputDelta]) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
            await queue.put((index, done))
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
