"""HTTP plumbing shared by the native and the OpenAI routes: app keys, JSON errors, the timeline, error, API-key and
router token middlewares, body parsing and SSE writing."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from pdserve.cluster_auth import HEADER, AuthError, ClusterAuth
from pdserve.server.metrics import ServerMetrics
from pdserve.server.tokenizer_manager import Exchange, RequestRejected, TokenizerManager
from pdserve.server.validation_errors import validation_problems

logger = logging.getLogger(__name__)

TM_KEY = web.AppKey("tokenizer_manager", TokenizerManager)
ARGS_KEY = web.AppKey("args", object)
METRICS_KEY = web.AppKey("metrics", ServerMetrics)
EXCHANGE_KEY = web.RequestKey("exchange", Exchange)  # on a generation route's request
PUBLIC_PATHS = frozenset({"/health"})
GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
ROLE_SWITCH_PATH = "/pd_role_switch"
ROUTER_ONLY_PATHS = GENERATION_PATHS | {ROLE_SWITCH_PATH}  # with a cluster secret: the router's token required

# OpenAI's error types by status; any other 4xx is an invalid request and any 5xx a server error. `code` is
# always the HTTP status, an int, as in SGLang's error responses.
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                429: "rate_limit_error"}

ModelT = TypeVar("ModelT", bound=BaseModel)
# The only way a lone surrogate gets into a parsed body (the UTF-8 decoder refuses encoded ones); a body without
# one is not walked.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def json_response(data: Any, status: int = 200) -> web.Response:
    """JSON with non-ASCII text as UTF-8 (readable in curl), not \\u escapes."""
    return web.json_response(data, status=status, dumps=_dumps)


def _dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False)


def error_body(status: int, message: str) -> dict:
    error_type = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "code": status}}


def error_response(status: int, message: str) -> web.Response:
    return json_response(error_body(status, message), status=status)


@web.middleware
async def timeline_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """A generation route's requests keep their timelines in the request's `Exchange`, recorded once its answer
    has started (the outermost middleware: error answers too) or it failed or was abandoned."""
    if request.path not in GENERATION_PATHS:
        return await handler(request)
    exchange = request[EXCHANGE_KEY] = Exchange()
    try:
        response = await handler(request)
        await response.prepare(request)  # a no-op for a stream, which started its answer itself
        return response
    finally:
        request.app[TM_KEY].finish_timelines(exchange)


async def mark_answer_started(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: the answer's first bytes go out now (a stream's first event follows at once)."""
    exchange = request.get(EXCHANGE_KEY)
    if exchange is not None:
        exchange.answer_started()


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except (ApiError, RequestRejected) as exc:
        response = error_response(exc.status, exc.message)
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


def body_timeout_middleware(seconds: float) -> Any:
    """A body that takes longer than `seconds` to arrive is answered 408 and its connection closed, so a client
    that sends headers and stalls holds nothing."""

    @web.middleware
    async def read_body_in_time(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            async with asyncio.timeout(seconds):
                await request.read()  # kept by aiohttp for the handler's own read
        except TimeoutError:
            response = error_response(408, f"the request body did not arrive within {seconds:g} s")
            response.force_close()
            return response
        return await handler(request)

    return read_body_in_time


def auth_middleware(api_key: str) -> Any:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check_api_key(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path not in PUBLIC_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")
        return await handler(request)

    return check_api_key


def router_auth_middleware(auth: ClusterAuth) -> Any:
    """A PD server with a cluster secret takes generation requests (and so bootstrap fields) and role switches only
    from the router: each needs the router's `X-PD-Auth` token over its method, path and body."""

    @web.middleware
    async def check_router_token(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method == "POST" and request.path in ROUTER_ONLY_PATHS:
            try:
                auth.verify_token(request.headers.get(HEADER), "POST", request.path_qs, await request.read())
            except AuthError as exc:
                raise ApiError(401, f"PD requests are accepted only from the router ({exc})") from None
        return await handler(request)

    return check_router_token


async def parse_body(request: web.Request, model: type[ModelT]) -> ModelT:
    data = parse_json(await request.read())
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ApiError(400, _validation_message(exc)) from exc


def parse_json(raw: bytes) -> Any:
    """Strict JSON: no NaN or Infinity, no lone UTF-16 surrogate (it is not text the tokenizer could encode), a
    bounded nesting depth and integers of bounded length; any of these is the client's 400."""
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError as exc:
        raise ApiError(400, "malformed JSON body: nested too deeply") from exc
    except ValueError as exc:  # also invalid UTF-8 and integers past Python's digit limit
        raise ApiError(400, f"malformed JSON body: {exc}") from exc
    surrogate = _lone_surrogate(data) if _SURROGATE_ESCAPE.search(raw) else None
    if surrogate is not None:
        raise ApiError(400, f"malformed JSON body: the lone UTF-16 surrogate {surrogate!r} is not a character")
    return data


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _lone_surrogate(data: Any) -> str | None:
    """The first string (value or key) holding a lone surrogate, anywhere in the parsed body."""
    pending = [data]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, str) and not item.isascii():
            try:
                item.encode()
            except UnicodeEncodeError as exc:
                return item[exc.start:exc.end]
    return None


def _validation_message(exc: ValidationError) -> str:
    return "invalid request: " + "; ".join(validation_problems(exc.errors()))


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
    """Send `first` then every event of `events` as SSE, then `[DONE]`; a vanished client just ends it. aiohttp
    ends the stream after the handler, quietly when a client that had its `[DONE]` has already closed."""
    response = await open_sse(request)
    try:
        if first is not None:
            await send_sse(response, first)
        async for event in events:
            await send_sse(response, event)
        await send_sse(response, "[DONE]")
    except ConnectionResetError:
        logger.info("client went away mid-stream; its request was aborted")
    except RequestRejected as exc:  # refused or failed after the stream started: report in-band
        await send_sse(response, error_body(exc.status, exc.message))
        await send_sse(response, "[DONE]")
    return response


async def stream_with_early_errors(request: web.Request, events: AsyncIterator[dict]) -> web.StreamResponse:
    """Wait for the first event before answering, so a refused request still gets a plain 4xx."""
    async with aclosing(events) as events:
        first = await anext(events, None)
        return await stream_sse(request, events, first)
