"""The server's SSE stream end: a client that closes right after `[DONE]` is no "went away", one that leaves
mid-stream is."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct

from aiohttp import web

from pdserve.server import http_common

WENT_AWAY = "went away"


async def two_events():
    yield {"text": "a"}
    yield {"text": "b"}


async def read_until(loop, sock: socket.socket, marker: bytes) -> None:
    received = b""
    while marker not in received:
        chunk = await loop.sock_recv(sock, 65536)
        assert chunk, "the server closed the stream early"
        received += chunk


def close_with_reset(sock: socket.socket) -> None:
    """Close so that the server's next write fails at once (RST, not FIN)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


async def stream_and_close(marker: bytes) -> None:
    """A raw client streams two events from `stream_sse`, reads up to `marker` and resets the connection; the
    handler's next write waits until the reset has reached the server, so it finds the connection gone."""
    ended = asyncio.Event()
    send = http_common.send_sse

    async def send_then_wait_for_the_close(response: web.StreamResponse, payload) -> None:
        await send(response, payload)
        if marker in json.dumps(payload).encode():
            while (transport := response._req.transport) is not None and not transport.is_closing():
                await asyncio.sleep(0.005)

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            return await http_common.stream_sse(request, two_events())
        finally:
            ended.set()

    http_common.send_sse = send_then_wait_for_the_close
    app = web.Application()
    app.router.add_get("/stream", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", runner.addresses[0][1]))
        await loop.sock_sendall(sock, b"GET /stream HTTP/1.1\r\nHost: s\r\n\r\n")
        await read_until(loop, sock, marker)
        close_with_reset(sock)
        await asyncio.wait_for(ended.wait(), 5)
        await asyncio.sleep(0.05)  # aiohttp's end of the response, after the handler
    finally:
        http_common.send_sse = send
        await runner.cleanup()


def went_away_lines(caplog, marker: bytes) -> list[str]:
    with caplog.at_level(logging.INFO, logger=http_common.logger.name):
        asyncio.run(stream_and_close(marker))
    return [r.getMessage() for r in caplog.records if WENT_AWAY in r.getMessage()]


def test_a_client_that_closes_after_done_is_not_logged_as_gone(caplog):
    assert went_away_lines(caplog, b"[DONE]") == []


def test_a_client_that_leaves_mid_stream_is_logged_as_gone(caplog):
    assert went_away_lines(caplog, b'"a"') == ["client went away mid-stream; its request was aborted"]
