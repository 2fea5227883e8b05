"""Request dispatch: pick a (prefill, decode) pair or one regular worker, send, relay, retry, abort the other half.

One attempt sends the request to the *main* upstream (decode, or the regular worker) whose answer the client gets,
and in PD mode concurrently to the *side* upstream (prefill), whose answer is drained in the background and only
awaited when input logprobs must be merged. Until the first byte goes to the client, a connection failure or a
5xx from either half aborts the other half and retries with a new pair and a new room.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import sys
import time
import uuid
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from .config import Role, RouterConfig
from .metrics import RouterMetrics
from .payload import (FirstEventMerger, attempt_rid, batch_size, body_rids, error_body, error_response,
                      inject_bootstrap, merge_json_response, prefill_items_by_index, routing_key)
from .policies import make_policy
from .workers import NoHealthyWorker, Worker, WorkerRegistry

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:
    from async_timeout import timeout

log = logging.getLogger("pdserve_router")
CONNECTION_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class UpstreamError(Exception):
    """One half failed: `status` None means the connection failed."""

    def __init__(self, worker: Worker, status: int | None, body: bytes = b"", detail: str = ""):
        self.worker, self.status, self.body = worker, status, body
        what = f"HTTP {status}" if status is not None else "connection failed"
        what += f" ({detail})" if detail else ""
        super().__init__(f"{worker.role} {worker.url}: {what}")

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


@dataclass(slots=True)
class RequestContext:
    request: web.Request
    path: str
    body: dict
    request_id: str
    started: float
    stream: bool
    batch: int | None
    return_logprob: bool
    response: web.StreamResponse | None = None
    excluded: set[str] = field(default_factory=set)


@dataclass(slots=True)
class Attempt:
    ctx: RequestContext
    number: int
    main: Worker
    side: Worker | None
    rid: str
    body_rid: str | list[str] | None
    main_done: bool = False
    first_received: bool = False
    side_task: asyncio.Task | None = None
    aborted: set[str] = field(default_factory=set)


class Dispatcher:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry, session: aiohttp.ClientSession,
                 metrics: RouterMetrics):
        self.config, self.registry, self.session, self.metrics = config, registry, session, metrics
        self.main_role: Role = "decode" if config.mode == "pd" else "regular"
        roles: tuple[Role, ...] = ("prefill", "decode") if config.mode == "pd" else ("regular",)
        self.policies = {role: make_policy(config.policy_for(role), config) for role in roles}
        self.needs_key = any(config.policy_for(role) == "cache_aware" for role in roles)
        self.auth = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.background: set[asyncio.Task] = set()

    async def handle(self, request: web.Request, path: str, body: dict) -> web.StreamResponse:
        ctx = RequestContext(request, path, body, request.headers.get("X-Request-Id") or uuid.uuid4().hex,
                             time.perf_counter(), bool(body.get("stream")), batch_size(path, body),
                             path == "/generate" and bool(body.get("return_logprob")))
        try:
            async with timeout(self.config.request_timeout_s):
                return await self.with_retries(ctx)
        except asyncio.TimeoutError:
            self.metrics.errors.inc(kind="timeout")
            message = f"request timed out after {self.config.request_timeout_s:g} s"
            log.warning("rid=%s %s", ctx.request_id, message)
            if ctx.response is None:
                return error_response(504, message, ctx.request_id)
            await self.end_stream_with_error(ctx, 504, message)
            return ctx.response
        except asyncio.CancelledError:
            self.metrics.errors.inc(kind="client_disconnect")
            log.info("rid=%s client went away before the answer", ctx.request_id)
            raise
        finally:
            self.metrics.duration.observe(time.perf_counter() - ctx.started)

    async def with_retries(self, ctx: RequestContext) -> web.StreamResponse:
        last_error: UpstreamError | None = None
        key = routing_key(ctx.path, ctx.body) if self.needs_key else None
        for number in range(self.config.max_retries + 1):
            try:
                attempt = self.new_attempt(ctx, number, key)
            except NoHealthyWorker as exc:
                self.metrics.errors.inc(kind="no_worker")
                message = str(exc) + (f"; last error: {last_error}" if last_error else "")
                log.warning("rid=%s %s", ctx.request_id, message)
                return error_response(503, message, ctx.request_id)
            try:
                return await self.run_attempt(attempt)
            except UpstreamError as exc:
                self.metrics.errors.inc(kind=exc.kind)
                if not exc.retryable:
                    return exc.client_response(ctx.request_id)
                last_error = exc
                ctx.excluded.add(exc.worker.url)
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
        main = self.policies[self.main_role].select(self.registry.available(self.main_role, excluded), key)
        side = None
        if self.config.mode == "pd":
            side = self.policies["prefill"].select(self.registry.available("prefill", excluded), key)
        rid = attempt_rid(ctx.request_id, number)
        body_rid = body_rids(ctx.body.get("rid"), ctx.request_id, ctx.batch, ctx.path, number)
        return Attempt(ctx, number, main, side, rid, body_rid)

    async def run_attempt(self, attempt: Attempt) -> web.StreamResponse:
        ctx = attempt.ctx
        body = inject_bootstrap(ctx.body, ctx.path, attempt.side, ctx.batch) if attempt.side else dict(ctx.body)
        if attempt.body_rid is not None:
            body["rid"] = attempt.body_rid
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "X-Request-Id": attempt.rid, **self.auth}
        attempt.main.in_flight += 1
        main_task = asyncio.ensure_future(self.open_main(attempt, data, headers))  # decode goes out first
        if attempt.side:
            attempt.side_task = self.start_side(attempt, data, headers)
        log.debug("rid=%s attempt %d -> %s%s", attempt.rid, attempt.number, attempt.main.url,
                  f" + {attempt.side.url}" if attempt.side else "")
        dispatched = time.perf_counter()
        resp: aiohttp.ClientResponse | None = None
        try:
            resp, first = await self.race_side(attempt, main_task)
            attempt.first_received = True
            return await self.respond(attempt, resp, first, dispatched - ctx.started)
        except BaseException as exc:
            self.abort_pair(attempt, exc)
            raise
        finally:
            attempt.main.in_flight -= 1
            if resp is not None:
                resp.release()

    def start_side(self, attempt: Attempt, data: bytes, headers: dict) -> asyncio.Task:
        side = attempt.side
        side.in_flight += 1
        task = asyncio.create_task(self.fetch_side(side, attempt.ctx.path, data, headers))

        def settle(done: asyncio.Task) -> None:
            side.in_flight -= 1
            if done.cancelled():
                return
            exc = done.exception()
            self.registry.record(side, not (isinstance(exc, UpstreamError) and exc.retryable))
            if exc is not None and attempt.first_received and not attempt.main_done:
                log.warning("rid=%s prefill failed after streaming began (%s); aborting decode", attempt.rid, exc)
                self.metrics.errors.inc(kind="stream")
                self.send_abort(attempt.main, attempt)

        task.add_done_callback(settle)
        return task

    async def fetch_side(self, worker: Worker, path: str, data: bytes, headers: dict) -> bytes:
        try:
            async with self.session.post(worker.url + path, data=data, headers=headers) as resp:
                body = await resp.read()
        except CONNECTION_ERRORS as exc:
            raise UpstreamError(worker, None, detail=str(exc) or type(exc).__name__) from exc
        if resp.status >= 400:
            raise UpstreamError(worker, resp.status, body)
        return body

    async def open_main(self, attempt: Attempt, data: bytes, headers: dict) -> tuple[aiohttp.ClientResponse, bytes]:
        """Headers plus the first chunk (streaming) or the whole body; failures raise UpstreamError."""
        worker = attempt.main
        try:
            resp = await self.session.post(worker.url + attempt.ctx.path, data=data, headers=headers)
            try:
                if resp.status >= 400 or not attempt.ctx.stream:
                    body = await resp.read()
                    attempt.main_done = True
                else:
                    body = await resp.content.readany()
            except BaseException:
                resp.release()
                raise
        except CONNECTION_ERRORS as exc:
            self.registry.record(worker, False)
            raise UpstreamError(worker, None, detail=str(exc) or type(exc).__name__) from exc
        self.registry.record(worker, resp.status < 500)
        if resp.status >= 400:
            resp.release()
            raise UpstreamError(worker, resp.status, body)
        return resp, body

    async def race_side(self, attempt: Attempt, main_task: asyncio.Future):
        """Awaits `main_task`, but fails fast with the side's error if the prefill half fails first."""
        side_task = attempt.side_task
        try:
            if side_task is not None and not side_task.done():
                await asyncio.wait((main_task, side_task), return_when=asyncio.FIRST_COMPLETED)
            if side_task is not None and side_task.done() and not main_task.done():
                side_task.result()  # raises the side's UpstreamError; a success falls through
            return await main_task
        finally:
            if not main_task.done():
                main_task.cancel()
                await asyncio.gather(main_task, return_exceptions=True)

    async def respond(self, attempt: Attempt, resp: aiohttp.ClientResponse, first: bytes,
                      pre_dispatch: float) -> web.StreamResponse:
        ctx = attempt.ctx
        prefill_items = None
        if ctx.return_logprob and attempt.side_task is not None:
            prefill_body = await attempt.side_task
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
            response = web.Response(status=resp.status, body=first, headers=headers,
                                    content_type=resp.content_type or "application/json")
            self.metrics.added_latency.observe(pre_dispatch + time.perf_counter() - received)
            return response
        response = web.StreamResponse(status=resp.status, headers={**SSE_HEADERS, **headers})
        await response.prepare(ctx.request)
        ctx.response = response
        merger = FirstEventMerger(prefill_items) if prefill_items else None
        if await self.write_client(attempt, merger.feed(first) if merger else first):
            self.metrics.added_latency.observe(pre_dispatch + time.perf_counter() - received)
            await self.relay(attempt, resp, merger)
        return response

    async def relay(self, attempt: Attempt, resp: aiohttp.ClientResponse, merger: FirstEventMerger | None) -> None:
        while True:
            try:
                chunk = await resp.content.readany()
            except CONNECTION_ERRORS as exc:
                self.registry.record(attempt.main, False)
                self.metrics.errors.inc(kind="stream")
                log.warning("rid=%s %s stream broke after streaming began: %s", attempt.rid, attempt.main.role, exc)
                self.abort_pair(attempt, UpstreamError(attempt.main, None, detail=str(exc)))
                await self.end_stream_with_error(attempt.ctx, 502, f"upstream stream broke: {attempt.main.url}")
                return
            if not chunk:
                break
            if not await self.write_client(attempt, merger.feed(chunk) if merger else chunk):
                return
        attempt.main_done = True
        if merger and not await self.write_client(attempt, merger.flush()):
            return
        await attempt.ctx.response.write_eof()

    async def write_client(self, attempt: Attempt, data: bytes) -> bool:
        """Sends bytes to the client; when the client has gone away, aborts both halves and returns False."""
        try:
            await attempt.ctx.response.write(data)
            return True
        except CONNECTION_ERRORS as exc:
            self.metrics.errors.inc(kind="client_disconnect")
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
        if not attempt.main_done and failed is not attempt.main:
            self.send_abort(attempt.main, attempt)
        side_task = attempt.side_task
        if side_task is not None and not side_task.done():
            side_task.cancel()
            if failed is not attempt.side:
                self.send_abort(attempt.side, attempt)

    def send_abort(self, worker: Worker, attempt: Attempt) -> None:
        if worker.url in attempt.aborted:
            return
        attempt.aborted.add(worker.url)
        self.metrics.aborts.inc(role=worker.role)
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
