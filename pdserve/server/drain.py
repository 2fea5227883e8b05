"""The server's graceful shutdown: once draining, new generation requests and /health get 503 while the requests in
flight finish; `serve.py` then ends the rest with an error (in-band on a stream) and stops. A role switch pauses
new generation requests the same way (503, which the router retries on another instance) while /health stays up."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from pdserve.server.http_common import GENERATION_PATHS, ApiError

SHUTTING_DOWN = "the server is shutting down"


class Drain:
    """Counts the generation requests in flight and refuses new ones once `start` was called, or while `paused`."""

    def __init__(self) -> None:
        self.draining = False
        self.paused: str | None = None  # why new generation requests are refused for now
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def start(self) -> None:
        self.draining = True

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        generation = request.method == "POST" and request.path in GENERATION_PATHS
        if self.draining and (generation or request.path == "/health"):
            raise ApiError(503, SHUTTING_DOWN)
        if generation and self.paused:
            raise ApiError(503, self.paused)
        if not generation:
            return await handler(request)
        self.in_flight += 1
        self.idle.clear()
        try:
            return await handler(request)
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self.idle.set()
