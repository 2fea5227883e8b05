"""Request dispatch: pick a (prefill, decode) pair or one regular worker, send, relay, retry, abort the other half.

One attempt sends the request to the *main* upstream (decode, or the regular worker) whose answer the client gets,
and in PD mode right after it to the *side* upstream (prefill), whose answer is collected in the background and only
awaited when input logprobs must be merged. Until the first byte goes to the client, a connection failure or a
5xx from either half aborts the other half and retries with a new pair and a new room.

Both halves go over `upstream.UpstreamPool` (keep-alive connections, the request written in the handler's own
step, the response parsed in the protocol); the handler waits on one future for the main half's first bytes, which
the side half's failure interrupts, so a warm request creates no task besides aiohttp's handler task.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from .cluster_auth import RequestSigner
from .conditional import (Booking, LearnedOverhead, LoadAwareRule, LocalPrefillRule, PromptSizer,
                          estimate_prompt_tokens, text_bytes)
from .config import Role, RouterConfig
from .metrics import RouterMetrics
from .payload import (BOOTSTRAP_KEYS, BadRequest, FirstEventMerger, attempt_rid, batch_size, body_rids,
                      bootstrap_fields, check_short_fields, encode_body, error_body, error_response, merge_json_response,
                      prefill_items_by_index, prompt_only, routing_key)
from .policies import make_policy
from .sse import WholeEvents
from .timeline import DISPATCHED, FIRST_BYTE, StageClock, TimelineRecorder
from .upstream import Exchange, UpstreamPool, timeout
from .workers import NoHealthyWorker, Worker, WorkerRegistry

log = logging.getLogger("pdserve_router")
CONNECTION_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
SHUTTING_DOWN = "the router is shutting down"
CLIENT_HIGH_WATER = 64 * 1024  # client send-buffer bytes above which the relay falls back to awaited writes
# A pdserve PD server answers 502 (its peer failed or refused) or 504 (its peer timed out) when a KV handoff fails:
# the instance that answered is alive; the other half of the pair is the suspect.
PEER_FAILURE_STATUSES = (502, 504)


class SSEResponse(web.StreamResponse):
    """A stream response whose head goes out with the first body bytes (one write, one packet, one wake-up of the
    client) instead of on its own at prepare(). The attribute is aiohttp's (3.9+); where it is unknown, the head
    simply goes out at prepare() as before."""

    _send_headers_immediately = False


def relay_sink(ctx: RequestContext, events: WholeEvents):
    """Writes relayed stream bytes, whole events only, straight to the client's transport, framed as HTTP/1.1
    chunks, from the upstream protocol's callback (no task wake-up per event). Refuses, so that the awaited
    `response.write()` path with its flow control takes over, while the client's send buffer is above the
    high-water mark or the client is gone. Only for a prepared chunked response whose head is already out (the
    first write flushed it)."""
    transport, response = ctx.request.transport, ctx.response
    if transport is None or response is None or not response.chunked or response.compression:
        return None

    def write(data: bytes) -> bool:
        if transport.is_closing() or transport.get_write_buffer_size() > CLIENT_HIGH_WATER:
            return False
        data = events.cut(data)
        if data:
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return True

    return write


class UpstreamError(Exception):
    """One half failed: `status` None means the connection failed."""

    def __init__(self, worker: Worker, status: int | None, body: bytes = b"", detail: str = ""):
        self.worker, self.status, self.body = worker, status, body
        what = f"HTTP {status}" if status is not None else "connection failed"
        what += f" ({detail})" if detail else ""
        message = upstream_error_message(body)
        what += f": {message}" if message else ""
        super().__init__(f"{worker.role} {worker.url}: {what}")

    @property
    def reports_peer_failure(self) -> bool:
        return self.status in PEER_FAILURE_STATUSES

    def suspect(self, attempt: Attempt) -> Worker:
        """The instance to leave out of the retry: the one that failed, or for a failed handoff its peer."""
        if self.reports_peer_failure and attempt.side is not None:
            return attempt.side if self.worker is attempt.main else attempt.main
        return self.worker

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status >= 500

    @property
    def kind(self) -> str:
        return "connect" if self.status is None else ("upstream_5xx" if self.status >= 500 else "upstream_4xx")

    def client_response(self, request_id: str) -> web.Response:
        """A non-retryable upstream error is passed through as the upstream sent it."""
        return web.Response(status=self.status or 502, body=self.body, content_type="application/json",
                            headers={"X-Request-Id": request_id})


def upstream_error_message(body: bytes, limit: int = 500) -> str:
    """The `message` of an OpenAI-style error body (pdserve's and the router's own), else ''."""
    if not body or not body.lstrip().startswith(b"{"):
        return ""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return ""
    message = error.get("message") if isinstance(error, dict) else error
    return message[:limit] if isinstance(message, str) else ""


@dataclass(slots=True)
class RequestContext:
    request: web.Request
    path: str
    body: dict
    raw: bytes | None  # the client's body bytes when they can be forwarded with fields appended (payload.spliceable)
    request_id: str
    started: float
    clock: StageClock
    stream: bool
    batch: int | None
    return_logprob: bool
    prompt_only: bool  # no new token: the decode server runs it alone, as colocated
    response: web.StreamResponse | None = None
    events: WholeEvents | None = None  # a stream's events as relayed to the client
    excluded: set[str] = field(default_factory=set)
    deadline: asyncio.Timeout | None = None  # the request timeout, brought forward to end it at shutdown
    shutting_down: bool = False

    @property
    def answered(self) -> bool:
        """The client has had a whole answer: a stream's `[DONE]` went out (a plain answer is never cancelled)."""
        return self.events is not None and self.events.done


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """Where the load-aware rule sent a prompt to be prefilled, and what it booked there."""

    worker: Worker  # the prefill instance, or the decode instance that prefills it itself
    booking: Booking
    predicted_wait_s: float | None  # the predicted wait there, without the path's learned overhead
    prompt_bytes: int | None  # a text prompt's UTF-8 length (its answer teaches the PromptSizer); None: token ids

    @property
    def path(self) -> str:
        return "local" if self.worker.role == "decode" else "remote"

    def release(self) -> None:
        self.worker.booked.release(self.booking)


@dataclass(slots=True)
class Attempt:
    ctx: RequestContext
    number: int
    main: Worker
    side: Worker | None
    rid: str
    body_rid: str | list[str] | None
    plan: PrefillPlan | None = None
    main_done: bool = False
    first_received: bool = False
    main_ex: Exchange | None = None
    side_ex: Exchange | None = None
    aborted: set[str] = field(default_factory=set)


class Dispatcher:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry, session: aiohttp.ClientSession,
                 metrics: RouterMetrics, upstream: UpstreamPool):
        self.config, self.registry, self.session, self.metrics = config, registry, session, metrics
        self.upstream = upstream
        roles: tuple[Role, ...] = ("prefill", "decode") if config.mode == "pd" else ("regular",)
        self.policies = {role: make_policy(config.policy_for(role), config, self.decision_counter(role))
                         for role in roles}
        self.local_rule = LocalPrefillRule(config.local_prefill_max_tokens, config.local_prefill_cost_factor)
        self.load_rule = (LoadAwareRule(config.local_prefill_alpha, config.local_prefill_kv_gate)
                          if config.local_prefill_by_load else None)
        self.overheads = {"local": LearnedOverhead(), "remote": LearnedOverhead()}
        self.sizer = PromptSizer()
        self.load_decisions: Counter[str] = Counter()  # by reason, for the summary at shutdown
        metrics.prompt_bytes_per_token.set(self.sizer.bytes_per_token.value)
        self.conditional = config.mode == "pd" and (self.local_rule.enabled or self.load_rule is not None)
        self.needs_key = self.conditional or any(config.policy_for(role) == "cache_aware" for role in roles)
        self.auth = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.auth_line = f"Authorization: Bearer {config.api_key}\r\n".encode() if config.api_key else b""
        self.signer = RequestSigner(config.disaggregation_secret) if config.disaggregation_secret else None
        self.background: set[asyncio.Task] = set()
        self.timeline = TimelineRecorder(metrics.stages, config.request_timeline_log)
        self.in_flight: dict[int, RequestContext] = {}  # by id()
        self.idle = asyncio.Event()
        self.idle.set()

    def decision_counter(self, role: Role) -> Callable[[str], None]:
        counters = {source: self.metrics.cache_decisions.labels(role=role, source=source)
                    for source in ("reported", "local", "load")}
        return lambda source: counters[source].inc()

    async def handle(self, request: web.Request, path: str, body: dict, raw: bytes | None = None) -> web.StreamResponse:
        started = time.perf_counter()
        request_id = request.headers.get("X-Request-Id") or f"{random.getrandbits(128):032x}"
        if "\r" in request_id or "\n" in request_id:
            raise BadRequest("X-Request-Id must be one line")
        check_short_fields(request_id, body)
        if any(key in body for key in BOOTSTRAP_KEYS):  # the rendezvous is the router's to choose, never a client's
            body, raw = {k: v for k, v in body.items() if k not in BOOTSTRAP_KEYS}, None
        ctx = RequestContext(request, path, body, raw, request_id, started, StageClock(request_id, started),
                             bool(body.get("stream")),
                             batch_size(path, body), path == "/generate" and bool(body.get("return_logprob")),
                             prompt_only(path, body))
        self.in_flight[id(ctx)] = ctx
        self.idle.clear()
        try:
            async with timeout(self.config.request_timeout_s) as ctx.deadline:
                return await self.with_retries(ctx)
        except asyncio.TimeoutError:
            status, message = self.timeout_answer(ctx)
            if ctx.response is None:
                return error_response(status, message, ctx.request_id)
            await self.end_stream_with_error(ctx, status, message)
            return ctx.response
        except asyncio.CancelledError:
            if not ctx.answered:  # a client that closes right after its [DONE] is no failure
                self.metrics.errors.labels(kind="client_disconnect").inc()
                log.info("rid=%s client went away before the answer", ctx.request_id)
            raise
        finally:
            del self.in_flight[id(ctx)]
            if not self.in_flight:
                self.idle.set()
            self.metrics.duration.observe(time.perf_counter() - ctx.started)
            self.timeline.finish(ctx.clock)

    def timeout_answer(self, ctx: RequestContext) -> tuple[int, str]:
        """The status and message of a request whose deadline passed (or was brought forward by `end_all`)."""
        if ctx.shutting_down:
            self.metrics.errors.labels(kind="shutdown").inc()
            return 503, SHUTTING_DOWN
        self.metrics.errors.labels(kind="timeout").inc()
        message = f"request timed out after {self.config.request_timeout_s:g} s"
        log.warning("rid=%s %s", ctx.request_id, message)
        return 504, message

    def end_all(self) -> None:
        """Ends every request in flight now, as its timeout would, with a 503 (in-band on a stream)."""
        now = asyncio.get_running_loop().time()
        for ctx in self.in_flight.values():
            if ctx.deadline is not None:
                ctx.shutting_down = True
                ctx.deadline.reschedule(now)

    async def with_retries(self, ctx: RequestContext) -> web.StreamResponse:
        last_error: UpstreamError | None = None
        key = routing_key(ctx.path, ctx.body) if self.needs_key else None
        for number in range(self.config.max_retries + 1):
            try:
                attempt = self.new_attempt(ctx, number, key)
            except NoHealthyWorker as exc:
                self.metrics.errors.labels(kind="no_worker").inc()
                message = str(exc) + (f"; last error: {last_error}" if last_error else "")
                log.warning("rid=%s %s", ctx.request_id, message)
                return error_response(503, message, ctx.request_id)
            try:
                return await self.run_attempt(attempt)
            except UpstreamError as exc:
                self.metrics.errors.labels(kind=exc.kind).inc()
                if not exc.retryable:
                    return exc.client_response(ctx.request_id)
                last_error = exc
                ctx.excluded.add(exc.suspect(attempt).url)
            if number < self.config.max_retries:
                self.metrics.retries.inc()
                log.warning("rid=%s attempt %d failed (%s); retrying with a new pair", ctx.request_id, number,
                            last_error)
                backoff = min(self.config.retry_backoff_s * 2 ** number, self.config.retry_max_backoff_s)
                await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
        message = f"all {self.config.max_retries + 1} attempts failed; last error: {last_error}"
        log.error("rid=%s %s", ctx.request_id, message)
        return error_response(502, message, ctx.request_id)

    def new_attempt(self, ctx: RequestContext, number: int, key) -> Attempt:
        excluded = frozenset(ctx.excluded)
        rid = attempt_rid(ctx.request_id, number)
        body_rid = body_rids(ctx.body.get("rid"), ctx.request_id, ctx.batch, ctx.path, number)
        if self.config.mode != "pd":
            main = self.policies["regular"].select(self.registry.available("regular", excluded), key)
            return Attempt(ctx, number, main, None, rid, body_rid)
        decodes = self.registry.available("decode", excluded)
        prefills = self.registry.available("prefill", excluded)
        prompt = None
        if self.conditional and ctx.batch is None:
            prompt = self.sizer.tokens(key) if self.load_rule is not None else estimate_prompt_tokens(key)
        if self.load_rule is not None and prompt is not None and not ctx.prompt_only:
            return self.attempt_by_load(ctx, number, key, prompt, prefills, decodes, rid, body_rid)
        main = self.policies["decode"].select(decodes, key)
        local = ctx.prompt_only or self.local_rule.prefill_locally(prompt, [w.load for w in prefills])
        side = None if local else self.policies["prefill"].select(prefills, key)
        self.metrics.prefills.labels(path="local" if local else "remote").inc()
        return Attempt(ctx, number, main, side, rid, body_rid)

    def attempt_by_load(self, ctx: RequestContext, number: int, key, prompt: int, prefills: list[Worker],
                        decodes: list[Worker], rid: str, body_rid) -> Attempt:
        """The load-aware rule's pair: a decode instance alone (the one predicted to give the first token soonest)
        when that beats the remote path, else the policies' pair; the prompt is booked where it is prefilled."""
        decision = self.load_rule.decide(prompt, [w.option() for w in prefills], [w.option() for w in decodes],
                                         self.overheads["remote"].value, self.overheads["local"].value)
        self.metrics.local_prefill_decisions.labels(reason=decision.reason).inc()
        self.load_decisions[decision.reason] += 1
        for path, seconds in (("local", decision.local_s), ("remote", decision.remote_s)):
            if seconds is not None:
                self.metrics.predicted_ttft.labels(path=path).observe(seconds)
        if decision.decode is not None:
            main, side = decodes[decision.decode], None
            prefiller, wait_s = main, main.option().local_wait_s(prompt)
        else:
            main, side = self.policies["decode"].select(decodes, key), self.policies["prefill"].select(prefills, key)
            prefiller, wait_s = side, side.option().prefill_wait_s(prompt)
        self.metrics.prefills.labels(path="remote" if side else "local").inc()
        plan = PrefillPlan(prefiller, prefiller.booked.book(prompt, time.monotonic()), wait_s,
                           text_bytes(key) if isinstance(key, str) and ctx.path == "/generate" else None)
        return Attempt(ctx, number, main, side, rid, body_rid, plan)

    def load_rule_summary(self) -> str | None:
        """One line on what the load-aware rule chose and learned (the router logs it at shutdown)."""
        if self.load_rule is None:
            return None
        reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(self.load_decisions.items())) or "none"
        return (f"--local-prefill-by-load choices: {reasons}; learned overheads: local "
                f"{self.overheads['local'].value * 1e3:.1f} ms, remote {self.overheads['remote'].value * 1e3:.1f} ms; "
                f"text prompts at {self.sizer.bytes_per_token.value:.2f} bytes per token")

    def learn_overhead(self, plan: PrefillPlan, stream: bool, first_byte_s: float) -> None:
        """A streamed request's first byte teaches its path's overhead (a whole answer's first byte comes after
        its last token)."""
        if stream and plan.predicted_wait_s is not None:
            overhead = self.overheads[plan.path]
            overhead.observe(first_byte_s, plan.predicted_wait_s)
            self.metrics.learned_overhead.labels(path=plan.path).set(overhead.value)

    def learn_prompt_size(self, attempt: Attempt, answer: bytes) -> None:
        """A /generate answer to a text prompt placed by load tells how many tokens that text was."""
        plan = attempt.plan
        if plan is not None and plan.prompt_bytes is not None:
            self.sizer.observe(plan.prompt_bytes, answer, attempt.ctx.stream)
            self.metrics.prompt_bytes_per_token.set(self.sizer.bytes_per_token.value)

    async def run_attempt(self, attempt: Attempt) -> web.StreamResponse:
        ctx = attempt.ctx
        extra = bootstrap_fields(ctx.path, attempt.side, ctx.batch) if attempt.side else {}
        if attempt.body_rid is not None:
            extra["rid"] = attempt.body_rid
        data = encode_body(ctx.raw, ctx.body, extra)
        signature = self.signer.header_line(ctx.path, data) if self.signer else b""  # every PD request
        fields = b"".join((b"Content-Type: application/json\r\nX-Request-Id: ",
                           attempt.rid.encode("utf-8", "surrogateescape"), b"\r\n", self.auth_line, signature))
        main, clock = attempt.main, ctx.clock
        clock.rid = attempt.body_rid if isinstance(attempt.body_rid, str) else attempt.rid  # what the servers log
        main.in_flight += 1
        attempt.main_ex = exchange = self.upstream.send(main.url, ctx.path, fields, data, whole=not ctx.stream)
        clock.mark(DISPATCHED[main.role])
        if attempt.side:  # decode goes out first
            self.start_side(attempt, data, fields)
            clock.mark(DISPATCHED[attempt.side.role])
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rid=%s attempt %d -> %s%s", attempt.rid, attempt.number, main.url,
                      f" + {attempt.side.url}" if attempt.side else "")
        dispatched = time.perf_counter()
        try:
            await self.open_main(attempt, exchange)
            attempt.first_received = True
            clock.mark(FIRST_BYTE[main.role])
            if attempt.plan is not None:
                attempt.plan.release()
                self.learn_overhead(attempt.plan, ctx.stream, time.perf_counter() - dispatched)
            return await self.respond(attempt, exchange, dispatched - ctx.started)
        except BaseException as exc:
            self.abort_pair(attempt, exc)
            raise
        finally:
            main.in_flight -= 1
            exchange.close()
            if attempt.plan is not None:
                attempt.plan.release()

    def start_side(self, attempt: Attempt, data: bytes, fields: bytes) -> None:
        side = attempt.side
        side.in_flight += 1
        attempt.side_ex = exchange = self.upstream.send(side.url, attempt.ctx.path, fields, data, whole=True)

        def settle(head: asyncio.Future) -> None:
            side.in_flight -= 1
            if attempt.plan is not None:
                attempt.plan.release()  # the prefill answered: its prompt is no longer queued there
            if head.cancelled():
                return
            error = self.side_error(attempt)
            self.registry.record(side, error is None or not error.retryable or error.reports_peer_failure)
            if error is None:
                attempt.ctx.clock.mark(FIRST_BYTE[side.role])
                return
            if not attempt.first_received:
                attempt.main_ex.interrupt(error)  # fail fast: the main half's head raises the side's error
            elif not attempt.main_done:
                log.warning("rid=%s prefill failed after streaming began (%s); aborting decode", attempt.rid, error)
                self.metrics.errors.labels(kind="stream").inc()
                self.send_abort(attempt.main, attempt)

        exchange.head.add_done_callback(settle)

    def side_error(self, attempt: Attempt) -> UpstreamError | None:
        """The side half's failure (connection, or a status of 400 and up) once its exchange has settled."""
        exchange, side = attempt.side_ex, attempt.side
        exc = exchange.head.exception()
        if exc is not None:
            return exc if isinstance(exc, UpstreamError) else UpstreamError(side, None,
                                                                           detail=str(exc) or type(exc).__name__)
        if exchange.status >= 400:
            return UpstreamError(side, exchange.status, exchange.body())
        return None

    async def open_main(self, attempt: Attempt, exchange: Exchange) -> None:
        """Waits for the head plus the first chunk (streaming) or the whole body; failures raise UpstreamError."""
        worker = attempt.main
        try:
            await exchange.head
        except UpstreamError:
            raise  # the side half failed first
        except CONNECTION_ERRORS as exc:
            self.registry.record(worker, False)
            raise UpstreamError(worker, None, detail=str(exc) or type(exc).__name__) from exc
        status = exchange.status
        if status >= 400 or not attempt.ctx.stream:
            attempt.main_done = True
        self.registry.record(worker, status < 500 or status in PEER_FAILURE_STATUSES)
        if status >= 400:
            raise UpstreamError(worker, status, exchange.take())

    async def respond(self, attempt: Attempt, exchange: Exchange, pre_dispatch: float) -> web.StreamResponse:
        ctx = attempt.ctx
        first = exchange.take()
        prefill_items = None
        if ctx.return_logprob and attempt.side_ex is not None:
            try:
                await attempt.side_ex.head
            except CONNECTION_ERRORS:
                pass  # side_error() turns it into an UpstreamError
            error = self.side_error(attempt)
            if error is not None:
                raise error
            prefill_body = attempt.side_ex.body()
            try:
                if ctx.stream:
                    prefill_items = prefill_items_by_index(prefill_body, stream=True)
                else:
                    first = merge_json_response(first, prefill_body)
            except ValueError as exc:
                raise UpstreamError(attempt.main, 502, detail=f"unparsable JSON for the logprob merge: {exc}") from exc
        received = time.perf_counter()
        headers = {"X-Request-Id": ctx.request_id}
        if not ctx.stream:
            response = web.Response(status=exchange.status, body=first, headers=headers,
                                    content_type=exchange.content_type or "application/json")
            self.metrics.added_latency.observe(pre_dispatch + time.perf_counter() - received)
            self.learn_prompt_size(attempt, first)
            return response
        response = SSEResponse(status=exchange.status, headers={**SSE_HEADERS, **headers})
        if ctx.request.version >= (1, 1):
            response.enable_chunked_encoding()  # what aiohttp would pick anyway; relay_sink() relies on it
        await response.prepare(ctx.request)
        ctx.response = response
        merger = FirstEventMerger(prefill_items) if prefill_items else None
        ctx.events = events = WholeEvents()
        first = events.cut(first)  # an empty write still sends the head, which relay_sink() needs out
        if await self.write_client(attempt, merger.feed(first) if merger else first):
            self.metrics.added_latency.observe(pre_dispatch + time.perf_counter() - received)
            self.learn_prompt_size(attempt, first)  # after the client has its first event
            await self.relay(attempt, exchange, events, merger)
        return response

    async def relay(self, attempt: Attempt, exchange: Exchange, events: WholeEvents,
                    merger: FirstEventMerger | None) -> None:
        """Relays the rest of the stream, whole events only; when the upstream breaks, an incomplete last event is
        dropped, so the error event that ends the client's stream follows a boundary."""
        sink = None if merger else relay_sink(attempt.ctx, events)
        while True:
            exchange.sink = sink  # (again after a fallback below)
            try:
                chunk = await exchange.readany()  # with a sink: the end, a failure, or bytes the sink could not take
            except CONNECTION_ERRORS as exc:
                self.registry.record(attempt.main, False)
                self.metrics.errors.labels(kind="stream").inc()
                log.warning("rid=%s %s stream broke after streaming began: %s", attempt.rid, attempt.main.role, exc)
                self.abort_pair(attempt, UpstreamError(attempt.main, None, detail=str(exc)))
                await self.end_stream_with_error(attempt.ctx, 502, f"upstream stream broke: {attempt.main.url}")
                return
            if not chunk:
                break
            chunk = events.cut(chunk)
            if chunk and not await self.write_client(attempt, merger.feed(chunk) if merger else chunk):
                return
        attempt.main_done = True
        rest = events.finish()
        if merger:
            rest = merger.feed(rest) + merger.flush()
        if rest:
            await self.write_client(attempt, rest)
        # aiohttp ends the response after the handler, quietly when the client has already closed

    async def write_client(self, attempt: Attempt, data: bytes) -> bool:
        """Sends bytes to the client; when the client has gone away, aborts both halves and returns False."""
        try:
            await attempt.ctx.response.write(data)
            return True
        except CONNECTION_ERRORS as exc:
            self.metrics.errors.labels(kind="client_disconnect").inc()
            log.info("rid=%s client went away: %s", attempt.rid, exc)
            self.abort_pair(attempt, exc)
            return False

    async def end_stream_with_error(self, ctx: RequestContext, status: int, message: str) -> None:
        try:
            await ctx.response.write(b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\n")
            await ctx.response.write_eof()
        except CONNECTION_ERRORS:
            pass

    def abort_pair(self, attempt: Attempt, cause: BaseException) -> None:
        """Aborts every half of a failed attempt that is still running and was not itself the failure."""
        failed = cause.worker if isinstance(cause, UpstreamError) else None
        if not attempt.main_done and not attempt.ctx.answered and failed is not attempt.main:
            self.send_abort(attempt.main, attempt)
        side_ex = attempt.side_ex
        if side_ex is not None and not side_ex.head.done():
            side_ex.close()
            if failed is not attempt.side:
                self.send_abort(attempt.side, attempt)

    def send_abort(self, worker: Worker, attempt: Attempt) -> None:
        if worker.url in attempt.aborted:
            return
        attempt.aborted.add(worker.url)
        self.metrics.aborts.labels(role=worker.role).inc()
        task = asyncio.create_task(self.post_abort(worker, attempt.body_rid or attempt.rid, attempt.rid))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def post_abort(self, worker: Worker, rid: str | list[str], request_id: str) -> None:
        log.info("rid=%s aborting on %s %s", request_id, worker.role, worker.url)
        try:
            async with self.session.post(worker.url + "/abort_request", json={"rid": rid},
                                         headers={"X-Request-Id": request_id, **self.auth},
                                         timeout=aiohttp.ClientTimeout(total=self.config.abort_timeout_s)) as resp:
                await resp.read()
        except (*CONNECTION_ERRORS, asyncio.TimeoutError) as exc:
            log.info("rid=%s abort on %s failed: %s", request_id, worker.url, exc)

    async def close(self) -> None:
        await asyncio.gather(*self.background, return_exceptions=True)
        self.timeline.close()
