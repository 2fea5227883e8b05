"""The stream relay in process: bytes go to the client from the upstream callback, and a slow client makes it fall
back to awaited writes with flow control, losing nothing."""

from __future__ import annotations

import asyncio
import json
import socket

from aiohttp import web

from pdserve_router import dispatch
from pdserve_router.app import create_app
from pdserve_router.cli import parse_config
from tools.stub import Fabric, StubServer


def dechunk(data: bytes) -> bytes:
    out, pos = [], 0
    while True:
        eol = data.index(b"\r\n", pos)
        size = int(data[pos:eol], 16)
        if size == 0:
            return b"".join(out)
        out.append(data[eol + 2:eol + 2 + size])
        assert data[eol + 2 + size:eol + 4 + size] == b"\r\n"
        pos = eol + 4 + size


async def relay_through_router(monkeypatch, tokens: int, pad: int, slow: bool,
                               interval_s: float = 0.0) -> tuple[list[dict], dict]:
    counts = {"direct": 0, "refused": 0}
    make_sink = dispatch.relay_sink

    def counting_sink(ctx):
        write = make_sink(ctx)
        assert write is not None  # an HTTP/1.1 client: the callback path is on

        def counted(data: bytes) -> bool:
            ok = write(data)
            counts["direct" if ok else "refused"] += 1
            return ok

        return counted

    monkeypatch.setattr(dispatch, "relay_sink", counting_sink)
    worker = StubServer("regular", Fabric(), tokens=tokens, event_pad=pad, token_interval_s=interval_s)
    await worker.start()
    app = create_app(parse_config(["--worker", worker.url, "--port", "0"]))
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that takes its time
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        body = json.dumps({"text": "hi", "stream": True}).encode()
        await loop.sock_sendall(sock, b"POST /generate HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        received = bytearray()
        while not received.endswith(b"\r\n0\r\n\r\n"):
            chunk = await loop.sock_recv(sock, 16384)
            assert chunk, "the router closed the stream early"
            received += chunk
            if slow:
                await asyncio.sleep(0.001)
        sock.close()
        head, _, rest = bytes(received).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head
        events = [json.loads(e[6:]) for e in dechunk(rest).split(b"\n\n") if e.startswith(b"data: {")]
        return events, counts
    finally:
        await runner.cleanup()
        await worker.stop()


def test_events_are_relayed_from_the_upstream_callback(monkeypatch):
    events, counts = asyncio.run(relay_through_router(monkeypatch, tokens=20, pad=0, slow=False, interval_s=0.005))
    assert [e["text"] for e in events] == [f"t{k} " for k in range(20)]
    assert counts["direct"] > 0 and counts["refused"] == 0


def test_slow_client_gets_a_large_stream_intact_through_the_fallback(monkeypatch):
    events, counts = asyncio.run(relay_through_router(monkeypatch, tokens=160, pad=65536, slow=True))
    assert [e["text"] for e in events] == [f"t{k} " for k in range(160)]  # every event, in order
    assert all(len(e["pad"]) == 65536 for e in events)
    assert counts["refused"] > 0  # the client's send buffer filled up: flow control went through aiohttp's writer
