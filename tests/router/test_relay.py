"""The stream relay in process: bytes go to the client from the upstream callback, and a slow client makes it fall
back to awaited writes with flow control, losing nothing; only whole SSE events are relayed, so a stream that
breaks ends with a clean error event."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web

from pdserve_router import dispatch
from pdserve_router.app import create_app
from pdserve_router.cli import parse_config
from pdserve_router.upstream import timeout
from pdserve_router.sse import WholeEvents
from tools.stub import SSE_HEADERS, Fabric, StubServer


def http_chunks(data: bytes) -> list[bytes]:
    """The chunks of a complete chunked HTTP/1.1 body."""
    out, pos = [], 0
    while True:
        eol = data.index(b"\r\n", pos)
        size = int(data[pos:eol], 16)
        if size == 0:
            return out
        out.append(data[eol + 2:eol + 2 + size])
        assert data[eol + 2 + size:eol + 4 + size] == b"\r\n"
        pos = eol + 4 + size


@asynccontextmanager
async def router_in_front_of(worker: StubServer):
    """Starts `worker` and a router in front of it; yields the router's port."""
    await worker.start()
    app = create_app(parse_config(["--worker", worker.url, "--port", "0"]))
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
        await worker.stop()


async def open_stream(port: int, slow: bool = False) -> socket.socket:
    """A raw HTTP/1.1 client's streamed /generate (with `slow`, a small receive buffer)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    if slow:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    body = json.dumps({"text": "hi", "stream": True}).encode()
    await loop.sock_sendall(sock, b"POST /generate HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


async def stream_through_router(worker: StubServer, slow: bool = False) -> list[bytes]:
    """Streams one /generate through a router in front of `worker` with a raw HTTP/1.1 client (with `slow`, one
    that takes its time) and returns the chunks of the router's answer."""
    async with router_in_front_of(worker) as port:
        loop = asyncio.get_running_loop()
        sock = await open_stream(port, slow)
        received = bytearray()
        async with timeout(20):
            while not received.endswith(b"\r\n0\r\n\r\n"):
                chunk = await loop.sock_recv(sock, 16384)
                assert chunk, "the router closed the stream early"
                received += chunk
                if slow:
                    await asyncio.sleep(0.001)
        sock.close()
        head, _, rest = bytes(received).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head
        return http_chunks(rest)


async def relay_through_router(monkeypatch, tokens: int, pad: int, slow: bool,
                               interval_s: float = 0.0) -> tuple[list[dict], dict]:
    counts = {"direct": 0, "refused": 0}
    make_sink = dispatch.relay_sink

    def counting_sink(ctx, events):
        write = make_sink(ctx, events)
        assert write is not None  # an HTTP/1.1 client: the callback path is on

        def counted(data: bytes) -> bool:
            ok = write(data)
            counts["direct" if ok else "refused"] += 1
            return ok

        return counted

    monkeypatch.setattr(dispatch, "relay_sink", counting_sink)
    worker = StubServer("regular", Fabric(), tokens=tokens, event_pad=pad, token_interval_s=interval_s)
    body = b"".join(await stream_through_router(worker, slow))
    events = [json.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
    return events, counts


def test_events_are_relayed_from_the_upstream_callback(monkeypatch):
    events, counts = asyncio.run(relay_through_router(monkeypatch, tokens=20, pad=0, slow=False, interval_s=0.005))
    assert [e["text"] for e in events] == [f"t{k} " for k in range(20)]
    assert counts["direct"] > 0 and counts["refused"] == 0


def test_slow_client_gets_a_large_stream_intact_through_the_fallback(monkeypatch):
    events, counts = asyncio.run(relay_through_router(monkeypatch, tokens=160, pad=65536, slow=True))
    assert [e["text"] for e in events] == [f"t{k} " for k in range(160)]  # every event, in order
    assert all(len(e["pad"]) == 65536 for e in events)
    assert counts["refused"] > 0  # the client's send buffer filled up: flow control went through aiohttp's writer


EVENTS = [b'data: {"text": "t%d ", "index": 0}\n\n' % k for k in range(3)] + [b"data: [DONE]\n\n"]
STREAM = b"".join(EVENTS)


@dataclass
class ScriptedUpstream(StubServer):
    """Streams fixed bytes, written in the given pieces with a pause after each (separate TCP segments); with
    `drop`, closes the connection after them instead of ending the response."""

    pieces: tuple[bytes, ...] = ()
    drop: bool = False

    async def generate(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        for piece in self.pieces:
            await response.write(piece)
            await asyncio.sleep(0.01)
        if self.drop:
            request.transport.close()
            await asyncio.sleep(30)  # cancelled as the connection goes (handler_cancellation)
        await response.write_eof()
        return response


def relay_pieces(pieces: tuple[bytes, ...], drop: bool = False) -> list[bytes]:
    return asyncio.run(stream_through_router(ScriptedUpstream("regular", Fabric(), pieces=pieces, drop=drop)))


def test_a_normal_stream_is_relayed_byte_for_byte():
    chunks = relay_pieces(tuple(EVENTS))
    assert b"".join(chunks) == STREAM
    assert all(chunk.endswith(b"\n\n") for chunk in chunks)


def test_events_split_across_segments_at_arbitrary_points_arrive_whole_and_byte_identical():
    boundary = len(EVENTS[0])
    cuts = [0, 3, boundary - 1, boundary + 1, boundary + 7, len(STREAM) - 1, len(STREAM)]  # mid-line, mid-"\n\n"
    pieces = tuple(STREAM[a:b] for a, b in zip(cuts, cuts[1:]))
    chunks = relay_pieces(pieces)
    assert b"".join(chunks) == STREAM
    assert all(chunk.endswith(b"\n\n") for chunk in chunks)


def test_a_stream_broken_mid_event_ends_with_the_last_whole_event_and_a_parseable_error_event():
    half = EVENTS[1][:len(EVENTS[1]) // 2]
    body = b"".join(relay_pieces((EVENTS[0], half), drop=True))
    first, error_event, after = body.split(b"\n\n")  # no partial bytes of the second event between them
    assert first + b"\n\n" == EVENTS[0] and after == b""
    assert error_event.startswith(b"data: ")
    error = json.loads(error_event[6:])["error"]
    assert error["code"] == 502 and "stream broke" in error["message"]


def test_whole_events_reassemble_any_three_way_split_exactly():
    for i in range(len(STREAM) + 1):
        for j in range(i, len(STREAM) + 1):
            events = WholeEvents()
            out = [events.cut(piece) for piece in (STREAM[:i], STREAM[i:j], STREAM[j:])]
            assert all(part.endswith(b"\n\n") for part in out if part), (i, j)
            assert b"".join(out) + events.finish() == STREAM, (i, j)


def test_whole_events_pass_an_aligned_chunk_through_uncopied_and_drop_nothing_held_on_finish():
    events = WholeEvents()
    assert events.cut(STREAM) is STREAM
    assert events.cut(b"data: {") == b"" and events.cut(b'"a": 1}\n') == b""
    assert events.finish() == b'data: {"a": 1}\n' and events.finish() == b""


async def stream_and_reset(marker: bytes) -> None:
    """Streams EVENTS through a router, the upstream pausing after each, and resets the connection once the
    client has read up to `marker`; the router's handler then ends (the upstream's end follows 10 ms later)."""
    async with router_in_front_of(ScriptedUpstream("regular", Fabric(), pieces=tuple(EVENTS))) as port:
        loop = asyncio.get_running_loop()
        sock = await open_stream(port)
        received = b""
        async with timeout(20):
            while marker not in received:
                received += await loop.sock_recv(sock, 16384)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, not FIN
        sock.close()
        await asyncio.sleep(0.2)


def router_went_away_lines(caplog, marker: bytes) -> list[str]:
    with caplog.at_level(logging.INFO, logger=dispatch.log.name):
        asyncio.run(stream_and_reset(marker))
    return [r.getMessage() for r in caplog.records if "went away" in r.getMessage()]


def test_a_client_that_closes_right_after_done_is_not_logged_as_gone(caplog):
    assert router_went_away_lines(caplog, b"[DONE]") == []


def test_a_client_that_leaves_mid_stream_is_logged_as_gone(caplog):
    assert router_went_away_lines(caplog, b"t0 ")
