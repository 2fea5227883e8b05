"""The router's own HTTP/1.1 client (pdserve_router.upstream) against scripted raw servers on loopback."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve_router.upstream import HIGH_WATER, MAX_HEAD_BYTES, UpstreamConnectionError, UpstreamPool


class ScriptedServer:
    """A raw TCP server: for each request it reads the head and Content-Length body, then calls `reply(conn_index,
    request)`, which returns the response bytes (or a list of pieces, sent with small pauses between them) and
    whether to close the connection afterwards."""

    def __init__(self, reply):
        self.reply = reply
        self.connections = 0
        self.requests: list[tuple[int, bytes, bytes]] = []  # (connection index, head, body)
        self.server: asyncio.AbstractServer | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = self.connections
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                body = await reader.readexactly(length)
                self.requests.append((index, head, body))
                pieces, close = self.reply(index, head, body)
                for piece in pieces if isinstance(pieces, list) else [pieces]:
                    writer.write(piece)
                    await writer.drain()
                    if isinstance(pieces, list):
                        await asyncio.sleep(0.01)
                if close:
                    writer.close()
                    return
        finally:
            writer.close()

    async def stop(self) -> None:
        for writer in self.writers:
            writer.close()
        self.server.close()
        await self.server.wait_closed()


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def with_server(reply, body):
    server = ScriptedServer(reply)
    url = await server.start()
    pool = UpstreamPool(connect_timeout_s=2.0)
    try:
        return await body(server, url, pool)
    finally:
        await pool.close()
        await server.stop()


def test_whole_body_keep_alive_reuses_one_connection():
    def reply(index, head, body):
        payload = json.dumps({"echo": json.loads(body), "conn": index}).encode()
        return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
            len(payload), payload), False

    async def body(server, url, pool):
        for i in range(3):
            ex = pool.send(url, "/generate", b"Content-Type: application/json\r\nX-Request-Id: r\r\n",
                           json.dumps({"i": i}).encode(), whole=True)
            await ex.head
            assert ex.status == 200 and ex.content_type == "application/json" and ex.done
            assert json.loads(ex.take()) == {"echo": {"i": i}, "conn": 0}
            ex.close()
        big = json.dumps({"input_ids": list(range(50000))}).encode()  # above JOIN_LIMIT: head and body written apart
        ex = pool.send(url, "/generate", b"", big, whole=True)
        await ex.head
        assert json.loads(ex.take())["echo"] == json.loads(big) and server.requests[-1][2] == big
        ex.close()
        assert server.connections == 1 and pool.opened == 1
        pool.forget(url)
        ex = pool.send(url, "/generate", b"", b"{}", whole=True)
        await ex.head
        assert server.connections == 2
        ex.close()
        head = server.requests[0][1].decode()
        assert head.startswith("POST /generate HTTP/1.1\r\n") and f"Host: {url[7:]}\r\n" in head
        assert "X-Request-Id: r\r\n" in head and "Content-Length: 8\r\n" in head

    run(with_server(reply, body))


def test_stream_head_waits_for_first_bytes_and_split_chunks_decode():
    events = [b"data: {\"k\": %d}\n\n" % k for k in range(4)]
    wire = SSE_HEAD + chunked(*events)

    def reply(index, head, body):
        if index == 0:  # everything, one byte at a time on the first connection
            return [wire[i:i + 1] for i in range(len(wire))][:40] + [wire[40:]], False
        return [SSE_HEAD, chunked(*events)], False

    async def body(server, url, pool):
        for _ in range(2):
            ex = pool.send(url, "/generate", b"", b"{}", whole=False)
            await ex.head
            assert ex.status == 200 and ex.headers["content-type"] == "text/event-stream"
            data = ex.take()
            assert data  # head resolves with the first body bytes, not before
            data += await ex.read()
            assert data == b"".join(events) and await ex.readany() == b""
            ex.close()
        assert server.connections == 1  # the first stream was read to its end, so its connection was reused

    run(with_server(reply, body))


def test_informational_response_trailers_and_close_delimited_body():
    def reply(index, head, body):
        if len(server_requests) == 1:
            return (b"HTTP/1.1 100 Continue\r\n\r\n" + SSE_HEAD + b"3;ext=1\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n"), False
        return b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end", True

    server_requests: list = []

    async def body(server, url, pool):
        server.requests = server_requests
        ex = pool.send(url, "/x", b"", b"{}", whole=True)
        await ex.head
        assert ex.status == 200 and ex.take() == b"abc"
        ex.close()
        for _ in range(2):  # HTTP/1.0 without keep-alive: read to the end of the connection, never reused
            ex = pool.send(url, "/x", b"", b"{}", whole=True)
            await ex.head
            assert ex.take() == b"until the end"
            ex.close()
        assert [conn for conn, _, _ in server.requests] == [0, 0, 1]

    run(with_server(reply, body))


def test_error_status_is_read_whole_and_connection_close_is_honoured():
    def reply(index, head, body):
        payload = b'{"error": "nope"}'
        return [b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(payload),
                payload], True

    async def body(server, url, pool):
        for _ in range(2):
            ex = pool.send(url, "/generate", b"", b"{}", whole=False)  # a stream, but errors come whole
            await ex.head
            assert ex.status == 503 and ex.body() == b'{"error": "nope"}' and ex.done
            ex.close()
        assert server.connections == 2

    run(with_server(reply, body))


def test_connection_refused_and_broken_stream_raise_connection_errors():
    def reply(index, head, body):
        return [SSE_HEAD, b"5\r\nhello\r\n"], True  # closes mid-body

    async def body(server, url, pool):
        ex = pool.send(url, "/generate", b"", b"{}", whole=False)
        await ex.head
        assert ex.take() == b"hello"
        with pytest.raises(UpstreamConnectionError, match="before the response was complete"):
            await ex.readany()
        ex.close()
        from cluster_util import free_port

        ex = pool.send(f"http://127.0.0.1:{free_port()}", "/generate", b"", b"{}", whole=True)
        with pytest.raises(UpstreamConnectionError, match="cannot connect"):
            await ex.head
        ex.close()

    run(with_server(reply, body))


def test_malformed_response_is_a_connection_error():
    def reply(index, head, body):
        return SSE_HEAD + b"zz\r\n", False

    async def body(server, url, pool):
        ex = pool.send(url, "/generate", b"", b"{}", whole=False)
        with pytest.raises(UpstreamConnectionError, match="malformed"):
            await ex.head
        ex.close()

    run(with_server(reply, body))


def test_oversized_head_is_malformed_and_bytes_past_a_response_spoil_its_connection():
    def reply(index, head, body):
        if index == 0:
            return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 2", False
        return b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES + 1) + b"\r\nContent-Length: 0\r\n\r\n", False

    async def body(server, url, pool):
        ex = pool.send(url, "/generate", b"", b"{}", whole=True)
        await ex.head
        assert ex.take() == b"ok"
        ex.close()
        ex = pool.send(url, "/generate", b"", b"{}", whole=True)  # a new connection: the first one was not reused
        with pytest.raises(UpstreamConnectionError, match="malformed"):
            await ex.head
        ex.close()
        assert server.connections == 2

    run(with_server(reply, body))


def test_abandoned_stream_closes_its_connection_and_idle_close_is_noticed():
    def reply(index, head, body):
        if index == 0:
            return [SSE_HEAD, b"1\r\na\r\n"], False  # never ends
        return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", index == 1

    async def body(server, url, pool):
        ex = pool.send(url, "/generate", b"", b"{}", whole=False)
        await ex.head
        ex.close()  # given up mid-stream: that connection must not carry the next request
        for expected_conn in (1, 2, 2):
            ex = pool.send(url, "/generate", b"", b"{}", whole=True)
            await ex.head
            assert ex.take() == b"ok" and server.requests[-1][0] == expected_conn
            ex.close()
            await asyncio.sleep(0.05)  # connection 1 was closed by the server after its reply: noticed while idle

    run(with_server(reply, body))


def test_slow_reader_pauses_the_instance_and_gets_every_byte():
    piece = b"x" * 65536
    count = 32  # 2 MiB, far above the high-water mark

    def reply(index, head, body):
        return [SSE_HEAD] + [b"%x\r\n%s\r\n" % (len(piece), piece)] * count + [b"0\r\n\r\n"], False

    async def body(server, url, pool):
        ex = pool.send(url, "/generate", b"", b"{}", whole=False)
        await ex.head
        total = len(ex.take())
        await asyncio.sleep(0.3)  # the server keeps sending; the client stops reading at the high-water mark
        assert ex.body() and len(ex.body()) <= HIGH_WATER + 256 * 1024 + 2 * len(piece)  # one read past the mark
        while chunk := await ex.readany():
            total += len(chunk)
        assert total == count * len(piece) and ex.done
        ex.close()
        ex = pool.send(url, "/generate", b"", b"{}", whole=False)  # the connection was resumed before reuse
        await ex.head
        assert len(ex.take()) + len(await ex.read()) == count * len(piece)
        assert server.connections == 1

    run(with_server(reply, body))


def test_connect_timeout():
    async def body():
        pool = UpstreamPool(connect_timeout_s=0.05)
        loop = asyncio.get_running_loop()

        async def never(*args, **kwargs):
            await asyncio.sleep(10)

        loop.create_connection = never  # an instance that never accepts
        ex = pool.send("http://127.0.0.1:9", "/generate", b"", b"{}", whole=True)
        with pytest.raises(UpstreamConnectionError, match="timed out"):
            await ex.head
        ex.close()
        await pool.close()

    run(body())


def test_sink_takes_bytes_past_the_high_water_mark_and_reading_resumes():
    from pdserve_router.upstream import Exchange

    class FakeConnection:
        def __init__(self):
            self.paused = False

        def pause(self):
            self.paused = True

        def resume(self):
            self.paused = False

    async def body():
        ex = Exchange(asyncio.get_running_loop(), whole=False)
        conn = ex.conn = FakeConnection()
        ex._on_head(200, {})
        ex._on_body(b"first")
        ex._wake()
        assert ex.head.done() and ex.take() == b"first"
        sunk = []
        ex.sink = lambda data: sunk.append(data) or True
        ex._on_body(b"x" * (HIGH_WATER + 1))  # one read past the mark pauses the instance...
        assert conn.paused
        ex._wake()  # ... and once the sink has taken it, reading resumes
        assert not conn.paused and sunk == [b"x" * (HIGH_WATER + 1)] and ex.body() == b""
        ex.sink = lambda data: False  # a refusing sink is dropped and the bytes wait for readany()
        ex._on_body(b"later")
        ex._wake()
        assert ex.sink is None and await ex.readany() == b"later"

    run(body())
