"""HTTP plumbing shared by the native and the OpenAI routes: app keys, JSON errors, the error and API-key
middlewares, body parsing and SSE writing."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from pdserve.server.metrics import ServerMetrics
from pdserve.server.tokenizer_manager import RequestRejected, TokenizerManager

logger = logging.getLogger(__name__)

TM_KEY = web.AppKey("tokenizer_manager", TokenizerManager)
ARGS_KEY = web.AppKey("args", object)
METRICS_KEY = web.AppKey("metrics", ServerMetrics)
PUBLIC_PATHS = frozenset({"/health"})

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
