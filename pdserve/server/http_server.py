"""The HTTP front end (aiohttp): SGLang's native routes, errors, API-key check, SSE helpers.

The OpenAI routes live in `openai_api.py`; both talk to the engine only through the tokenizer manager.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from pdserve.sampling_params import SamplingParams, SamplingParamsError
from pdserve.server.metrics import ServerMetrics
from pdserve.server.protocol import AbortRequestInput, GenerateReqInput, bootstrap_for, sglang_sampling_params
from pdserve.server.tokenizer_manager import Chunk, GenerateRequest, RequestRejected, TokenizerManager, merge_streams

logger = logging.getLogger(__name__)

TM_KEY = web.AppKey("tokenizer_manager", TokenizerManager)
ARGS_KEY = web.AppKey("args", object)
METRICS_KEY = web.AppKey("metrics", ServerMetrics)
MAX_BODY_BYTES = 64 * 1024 * 1024
HEALTH_GENERATE_TIMEOUT_SECONDS = 60.0
PUBLIC_PATHS = frozenset({"/health"})
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's marker for a PD request that transfers nothing (health checks)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}

ModelT = TypeVar("ModelT", bound=BaseModel)


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def json_response(data: Any, status: int = 200) -> web.Response:
    """JSON with non-ASCII text as UTF-8 (readable in curl), not \\u escapes."""
    return web.json_response(data, status=status, dumps=_dumps)


def _dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False)


def error_body(status: int, message: str, code: str | int | None = None) -> dict:
    error_type = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "code": code if code is not None else status}}


def error_response(status: int, message: str, code: str | int | None = None) -> web.Response:
    return json_response(error_body(status, message, code), status=status)


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except (ApiError, RequestRejected) as exc:
        response = error_response(exc.status, exc.message, exc.code)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = error_response(exc.status, exc.reason)
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception:
        logger.exception("internal error on %s %s", request.method, request.path)
        response = error_response(500, "internal server error")
    request.app[METRICS_KEY].http_error(response.status)
    return response


def auth_middleware(api_key: str) -> Any:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check_api_key(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path not in PUBLIC_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')", "invalid_api_key")
        return await handler(request)

    return check_api_key


async def parse_body(request: web.Request, model: type[ModelT]) -> ModelT:
    raw = await request.read()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ApiError(400, _validation_message(exc)) from exc


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors()[:5]:
        where = ".".join(str(p) for p in error["loc"]) or "body"
        parts.append(f"{where}: {error['msg']}")
    return "invalid request: " + "; ".join(parts)


def sampling_error(exc: SamplingParamsError | TypeError) -> ApiError:
    return ApiError(400, f"invalid sampling parameters: {exc}")


def check_bootstrap(args: Any, request: GenerateRequest) -> None:
    """A PD server serves only requests the router paired up; a colocated server ignores the fields."""
    if args.is_pd and (request.bootstrap_host is None or request.bootstrap_room is None):
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


def check_unique_rids(tm: TokenizerManager, requests: list[GenerateRequest]) -> None:
    rids = [r.rid for r in requests]
    if len(set(rids)) != len(rids):
        raise ApiError(400, "request ids in one batch must differ")
    for rid in rids:
        if tm.is_in_flight(rid):
            raise ApiError(400, f"request id {rid!r} is already in flight")


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
    last: Chunk | None = None

    def add(self, chunk: Chunk) -> None:
        out = chunk.out
        self.text += out.text
        self.output_ids.extend(out.new_token_ids)
        self.output_logprobs.extend(out.output_logprobs)
        self.output_top_logprobs.extend(out.output_top_logprobs)
        if chunk.input_logprobs is not None:
            self.input_logprobs = chunk.input_logprobs
            self.input_top_logprobs = out.input_top_logprobs
        self.last = chunk

    @property
    def finish_reason(self) -> dict | None:
        return self.last.out.finish_reason if self.last else None

    @property
    def prompt_tokens(self) -> int:
        return self.last.out.prompt_tokens if self.last else 0

    @property
    def completion_tokens(self) -> int:
        return self.last.out.completion_tokens if self.last else 0


async def collect(streams: list[AsyncIterator[Chunk]]) -> list[Generation]:
    generations = [Generation() for _ in streams]
    async with aclosing(merge_streams(streams)) as merged:
        async for index, chunk in merged:
            generations[index].add(chunk)
    return generations


async def open_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    return response


async def send_sse(response: web.StreamResponse, payload: dict | str) -> None:
    data = payload if isinstance(payload, str) else _dumps(payload)
    await response.write(f"data: {data}\n\n".encode())


async def stream_sse(
    request: web.Request, events: AsyncIterator[dict], first: dict | None = None
) -> web.StreamResponse:
    """Send `first` then every event of `events` as SSE, then `[DONE]`; a vanished client just ends it."""
    response = await open_sse(request)
    try:
        if first is not None:
            await send_sse(response, first)
        async for event in events:
            await send_sse(response, event)
        await send_sse(response, "[DONE]")
        await response.write_eof()
    except ConnectionResetError:
        logger.info("client went away mid-stream; its request was aborted")
    except RequestRejected as exc:  # refused or failed after the stream started: report in-band
        await send_sse(response, error_body(exc.status, exc.message, exc.code))
        await send_sse(response, "[DONE]")
    return response


async def stream_with_early_errors(request: web.Request, events: AsyncIterator[dict]) -> web.StreamResponse:
    """Wait for the first event before answering, so a refused request still gets a plain 4xx."""
    async with aclosing(events) as events:
        first = await anext(events, None)
        return await stream_sse(request, events, first)


# --- native routes --------------------------------------------------------------------------------


async def generate(request: web.Request) -> web.StreamResponse:
    tm, args = request.app[TM_KEY], request.app[ARGS_KEY]
    body = await parse_body(request, GenerateReqInput)
    requests, is_batch = build_generate_requests(args, tm, body)
    check_unique_rids(tm, requests)
    streams = [tm.generate(r) for r in requests]
    with_text = body.return_text_in_logprobs
    if body.stream:
        return await stream_with_early_errors(request, _generate_events(streams, requests, is_batch, with_text))
    generations = await collect(streams)
    results = [generate_result(g, r, with_text) for g, r in zip(generations, requests)]
    return json_response(results if is_batch else results[0])


async def _generate_events(
    streams: list[AsyncIterator[Chunk]], requests: list[GenerateRequest], is_batch: bool, with_text: bool
) -> AsyncIterator[dict]:
    generations = [Generation() for _ in streams]
    async with aclosing(merge_streams(streams)) as merged:
        async for index, chunk in merged:
            generations[index].add(chunk)
            event = generate_result(generations[index], requests[index], with_text)
            if is_batch:
                event["index"] = index
            yield event


def build_generate_requests(args: Any, tm: TokenizerManager, body: GenerateReqInput) -> tuple[list[GenerateRequest], bool]:
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "give exactly one of text and input_ids")
    size = body.batch_size
    is_batch = size is not None
    prompts: list = (body.text if body.text is not None else body.input_ids) if is_batch else [body.text or body.input_ids]
    if is_batch:
        check_batch_size(args, size)
    rids = _per_item(body.rid, len(prompts), "rid")
    nested = _per_item(body.sampling_params, len(prompts), "sampling_params")
    requests = []
    for index, prompt in enumerate(prompts):
        try:
            params = sglang_sampling_params(body, nested[index])
            host, port, room = bootstrap_for(body, index)
        except (SamplingParamsError, TypeError) as exc:
            raise sampling_error(exc) from exc
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        input_ids = tm.tokenize(prompt) if isinstance(prompt, str) else list(prompt or [])
        tm.check_prompt(input_ids, params)
        req = GenerateRequest(rids[index] or new_rid(), input_ids, params,
                              bootstrap_host=host, bootstrap_port=port, bootstrap_room=room)
        with_logprobs(req, body.return_logprob, body.top_logprobs_num, body.logprob_start_len)
        check_bootstrap(args, req)
        requests.append(req)
    return requests, is_batch


def _per_item(value: Any, size: int, name: str) -> list:
    if value is None:
        return [None] * size
    if not isinstance(value, list):
        return [value] * size
    if len(value) != size:
        raise ApiError(400, f"{name} must have one entry per prompt ({size}), got {len(value)}")
    return value


def generate_result(generation: Generation, request: GenerateRequest, with_text: bool) -> dict:
    last = generation.last
    meta: dict[str, Any] = {
        "id": request.rid,
        "finish_reason": generation.finish_reason,
        "prompt_tokens": generation.prompt_tokens,
        "completion_tokens": generation.completion_tokens,
        "cached_tokens": last.out.cached_tokens if last else 0,
        "e2e_latency": last.e2e_latency if last else 0.0,
        "ttft": last.ttft if last else None,
    }
    if request.return_logprob:
        strip = (lambda entries: entries) if with_text else _without_text
        meta["output_token_logprobs"] = strip(generation.output_logprobs)
        meta["output_top_logprobs"] = [strip(e) for e in generation.output_top_logprobs]
        meta["input_token_logprobs"] = strip(generation.input_logprobs or [])
        meta["input_top_logprobs"] = [None if e is None else strip(e) for e in generation.input_top_logprobs or []]
    return {"text": generation.text, "output_ids": generation.output_ids, "meta_info": meta}


def _without_text(entries: list) -> list:
    return [[e[0], e[1], None] for e in entries]


async def health(request: web.Request) -> web.Response:
    return web.Response(text="")


async def health_generate(request: web.Request) -> web.Response:
    tm, args = request.app[TM_KEY], request.app[ARGS_KEY]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    probe = GenerateRequest(f"health-{new_rid()}", tm.tokenize("Hello"), params)
    if args.is_pd:
        probe.bootstrap_host, probe.bootstrap_room = FAKE_BOOTSTRAP_HOST, 0
    try:
        generations = await asyncio.wait_for(collect([tm.generate(probe)]), HEALTH_GENERATE_TIMEOUT_SECONDS)
    except TimeoutError as exc:
        raise ApiError(503, "the engine did not produce a token in time") from exc
    if not generations[0].output_ids:
        raise ApiError(503, f"the engine produced no token: {generations[0].finish_reason}")
    return web.Response(text="")


async def get_model_info(request: web.Request) -> web.Response:
    tm, args = request.app[TM_KEY], request.app[ARGS_KEY]
    info = {"model_path": args.model_path, "tokenizer_path": args.tokenizer_path or args.model_path,
            "served_model_name": args.model_name, "is_generation": True, **tm.model_info}
    return json_response(info)


async def get_server_info(request: web.Request) -> web.Response:
    tm, args = request.app[TM_KEY], request.app[ARGS_KEY]
    server_args = {k: v for k, v in dataclasses.asdict(args).items() if k not in ("api_key", "ipc_dir")}
    stats = await _scheduler_stats(tm)
    return json_response({**server_args, "model_info": tm.model_info, "scheduler": stats,
                              "requests_in_flight": len(tm.states), "time": time.time()})


async def _scheduler_stats(tm: TokenizerManager) -> dict:
    try:
        return await tm.get_stats()
    except TimeoutError as exc:
        raise ApiError(503, "the scheduler did not answer in time") from exc


async def flush_cache(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    try:
        flushed = await tm.flush_cache()
    except TimeoutError as exc:
        raise ApiError(503, "the scheduler did not answer in time") from exc
    if not flushed:
        raise ApiError(400, "cannot flush the cache while requests are running")
    return json_response({"success": True, "message": "Cache flushed."})


async def abort_request(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    body = await parse_body(request, AbortRequestInput)
    if body.abort_all:
        return json_response({"success": True, "aborted": tm.abort_all()})
    if not tm.abort(body.rid):
        raise ApiError(404, f"no request with id {body.rid!r} is in flight")
    return json_response({"success": True, "aborted": 1})


async def metrics(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    stats = await _scheduler_stats(tm)
    text = request.app[METRICS_KEY].render(stats, in_flight=len(tm.states))
    return web.Response(text=text, content_type="text/plain", headers={"X-Content-Type-Version": "0.0.4"})


def create_app(args: Any, tm: TokenizerManager, server_metrics: ServerMetrics) -> web.Application:
    from pdserve.server import openai_api

    middlewares = [error_middleware] + ([auth_middleware(args.api_key)] if args.api_key else [])
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[TM_KEY], app[ARGS_KEY], app[METRICS_KEY] = tm, args, server_metrics
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/get_model_info", get_model_info)
    app.router.add_get("/get_server_info", get_server_info)
    app.router.add_get("/flush_cache", flush_cache)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_get("/metrics", metrics)
    openai_api.add_routes(app)
    return app
