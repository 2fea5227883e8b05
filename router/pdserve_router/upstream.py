"""A lean HTTP/1.1 client for the generation requests the router sends to its instances.

aiohttp's client builds, per request, a ClientRequest and a ClientResponse (URL objects, multidicts, a timer, a
StreamReader) and on Python < 3.12 writes the body from a separate task, so the request leaves one loop iteration
after the handler asked for it. This client keeps a pool of keep-alive connections per instance, writes each
request (head and body in one buffer) to a pooled connection in the caller's own step, parses the response with
llhttp (`httptools`, the parser uvicorn uses) in the protocol's `data_received`, and wakes the caller only when it has what the caller waits for: the head plus the
first body bytes of a stream, or the whole body. No task is created unless a new connection must be opened.

It speaks only what the router needs: POST with a Content-Length body; responses framed by Content-Length,
chunked transfer coding, or the connection's end; 1xx responses skipped; http and https origins.
"""

from __future__ import annotations

import asyncio
import math
import socket
import ssl
import sys
import time
from collections import deque
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:
    from async_timeout import timeout

JOIN_LIMIT = 64 * 1024  # request bodies up to this size are copied behind the head and sent with one write
HIGH_WATER = 256 * 1024  # buffered stream bytes that pause reading from the instance until the relay catches up
MAX_HEAD_BYTES = 64 * 1024

# bodies are relayed as they come: no content coding (a compressed SSE stream could not be passed on as is)
_FIXED_FIELDS = b"Accept-Encoding: identity\r\n"


class UpstreamConnectionError(ConnectionError):
    """The connection could not be opened, or it broke (or the response was malformed) before the response was
    complete."""


class Origin:
    """Scheme, host and port of an instance URL, with the pieces a request needs pre-encoded."""

    __slots__ = ("host", "port", "ssl", "server_hostname", "host_line")

    def __init__(self, url: str):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if tls else 80)
        self.ssl = ssl.create_default_context() if tls else None
        self.server_hostname = self.host if tls else None
        netloc = parts.netloc.rpartition("@")[2]
        if not netloc.isascii():
            netloc = self.host.encode("idna").decode() + (f":{parts.port}" if parts.port else "")
        self.host_line = f"Host: {netloc}\r\n".encode("ascii")


class Exchange:
    """One request and its response.

    `head` resolves once the status and headers are in and, for a stream with a status below 400, the first body
    bytes (or the end of the body) too; for a `whole` exchange (and any status of 400 and up) once the body is
    complete. It raises UpstreamConnectionError when the connection fails first. After it: `status`, `headers`
    (lowercase names), `take()` for the bytes buffered so far, `readany()` for the next ones (b"" at the end) and
    `close()` when done with it (an exchange closed before its response is complete closes its connection).

    `sink`, when set, is handed body bytes from the protocol callback as they arrive, with no task wake-up; it
    returns False when it cannot take them (the bytes then stay buffered, the sink is dropped and a pending
    `readany()` returns them).
    """

    __slots__ = ("head", "whole", "status", "headers", "done", "error", "closed", "conn", "connect_task", "sink",
                 "_chunks", "_buffered", "_waiter", "_paused", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, whole: bool):
        self._loop = loop
        self.head: asyncio.Future = loop.create_future()
        self.whole = whole
        self.status = 0
        self.headers: dict[str, str] = {}
        self.done = False
        self.error: BaseException | None = None
        self.closed = False
        self.conn: _Connection | None = None
        self.connect_task: asyncio.Task | None = None
        self.sink: Callable[[bytes], bool] | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._waiter: asyncio.Future | None = None
        self._paused = False

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").partition(";")[0].strip()

    # consumer side

    def take(self) -> bytes:
        """Every body byte received and not taken yet."""
        chunks = self._chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._drained()
        return data

    def _drained(self) -> None:
        self._chunks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            if self.conn is not None:
                self.conn.resume()

    def body(self) -> bytes:
        """Every body byte received and not taken yet, left in place (a `whole` exchange's body once `head` is done)."""
        chunks = self._chunks
        if len(chunks) > 1:
            chunks[:] = [b"".join(chunks)]
        return chunks[0] if chunks else b""

    async def readany(self) -> bytes:
        """The next body bytes, b"" once the body is complete; raises UpstreamConnectionError if it broke."""
        if not self._chunks and not self.done:
            if self.error is not None:
                raise self.error
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.take()

    async def read(self) -> bytes:
        """The rest of the body."""
        chunks = []
        while chunk := await self.readany():
            chunks.append(chunk)
        return b"".join(chunks)

    def interrupt(self, exc: BaseException) -> None:
        """Makes a pending `head` raise `exc` (the other half of the pair failed first)."""
        if not self.head.done():
            self.head.set_exception(exc)

    def close(self) -> None:
        """Done with this exchange: a connection still carrying its response is closed, not reused."""
        if self.closed:
            return
        self.closed = True
        self.sink = None
        if self.connect_task is not None and not self.connect_task.done():
            self.connect_task.cancel()
        if self.head.done():
            if not self.head.cancelled():
                self.head.exception()  # retrieved: no "exception was never retrieved" noise
        else:
            self.head.cancel()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.cancel()
        conn = self.conn
        if conn is not None and not self.done:
            conn.abandon()
        self._chunks.clear()

    # protocol side

    def _on_head(self, status: int, headers: dict[str, str]) -> None:
        self.status, self.headers = status, headers
        if status >= 400:
            self.whole = True  # an error body is read whole

    def _on_body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self.whole and not self._paused and self.conn is not None:
            self._paused = True
            self.conn.pause()

    def _wake(self) -> None:
        """After a `data_received`: feeds the sink, resolves `head` or the pending `readany` when there is something
        for them."""
        if not self.head.done():
            if self.done or (self.status and not self.whole and self._chunks):
                self.head.set_result(None)
            return
        if self.sink is not None and self._chunks:
            if self.sink(self.body()):
                self._drained()
            else:
                self.sink = None
        waiter = self._waiter
        if waiter is not None and not waiter.done() and (self._chunks or self.done):
            waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.done or self.error is not None:
            return
        self.error = exc
        if not self.head.done():
            self.head.set_exception(exc)
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)


def watch_reachability(sock: socket.socket, timeout_s: float) -> None:
    """Close the connection with ETIMEDOUT once the peer has not acknowledged anything for `timeout_s`: TCP
    keep-alive probes start after a quiet third of it, so a partitioned or powered-off host is told apart from
    a slow but live one (whose kernel answers the probes) and its requests fail instead of waiting forever."""
    idle = max(1, round(timeout_s / 3))
    interval = max(1, round(timeout_s / 6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, math.ceil((timeout_s - idle) / interval)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(timeout_s * 1000))


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an instance; carries one exchange at a time. Responses are parsed by llhttp
    (`httptools`), whose callbacks feed the exchange as the bytes come."""

    __slots__ = ("pool", "key", "transport", "exchange", "closed", "idle_since", "_parser", "_status", "_headers",
                 "_head_bytes", "_in_head", "_finished", "_past_end", "_keep_alive", "_until_close")

    def __init__(self, pool: UpstreamPool, key: str):
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._status = 0
        self._headers: dict[str, str] = {}
        self._head_bytes = 0
        self._in_head = False  # between a response's first byte and the end of its head (trailers come after)
        self._finished = False  # the exchange's final response is complete
        self._past_end = False  # bytes came after it: the connection cannot be reused
        self._keep_alive = True
        self._until_close = False  # the body ends with the connection (no Content-Length, not chunked)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                watch_reachability(sock, self.pool.unreachable_timeout_s)
            except OSError:
                pass

    def start(self, exchange: Exchange, head: bytes, body: bytes) -> None:
        self.exchange = exchange
        exchange.conn = self
        self._status, self._finished = 0, False
        if len(body) <= JOIN_LIMIT:
            self.transport.write(head + body)  # one send, one packet
        else:
            self.transport.writelines((head, body))  # no copy of a large body

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def abandon(self) -> None:
        """The exchange was given up before its response was complete: the connection cannot be reused."""
        self.exchange = None
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # asyncio.Protocol

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:  # bytes nobody asked for (or for an abandoned exchange): not reusable
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if not self._finished:
                exchange._fail(UpstreamConnectionError(f"malformed response from {self.key}: {exc}"))
                self.exchange = None
                self.close()
                return
            self._past_end = True  # garbage after a complete response
        if self._finished:
            self._complete(exchange)
        exchange._wake()

    def eof_received(self) -> bool:
        exchange = self.exchange
        if exchange is not None and self._until_close and self._status >= 200 and not self._in_head:
            self._keep_alive = False
            self._finished = True
            self._complete(exchange)
            exchange._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        exchange, self.exchange = self.exchange, None
        if exchange is not None and not exchange.done:
            detail = f": {exc}" if exc else ""
            exchange._fail(UpstreamConnectionError(f"connection to {self.key} closed before the response was "
                                                   f"complete{detail}"))

    def _complete(self, exchange: Exchange) -> None:
        exchange.done = True
        exchange.conn = None
        self.exchange = None
        if exchange._paused:  # the rest of the body came in the same read that crossed the high-water mark
            exchange._paused = False
            self.resume()
        if self._past_end or not self._keep_alive:
            self.close()  # bytes past the response, or the instance said it closes: not reusable
        else:
            self.pool._release(self)

    # llhttp callbacks

    def on_message_begin(self) -> None:
        if self._finished:
            self._past_end = True
            return
        self._status, self._headers, self._head_bytes, self._in_head = 0, {}, 0, True

    def on_status(self, reason: bytes) -> None:
        self._count_head(reason)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head or self._finished:
            return  # a trailer field: nothing the router relays
        self._count_head(name, value)
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        headers = self._headers
        headers[key] = f"{headers[key]}, {text}" if key in headers else text

    def _count_head(self, *parts: bytes) -> None:
        self._head_bytes += sum(len(part) for part in parts)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise ValueError("response head too large")

    def on_headers_complete(self) -> None:
        if self._finished:
            return
        self._in_head = False
        parser, headers = self._parser, self._headers
        self._status = status = parser.get_status_code()
        if status < 200:
            return  # an informational response; the real one follows
        self._keep_alive = parser.should_keep_alive()
        encoding = headers.get("transfer-encoding", "")
        chunked = encoding.lower().rpartition(",")[2].strip() == "chunked"
        self._until_close = status not in (204, 304) and not chunked and "content-length" not in headers
        self.exchange._on_head(status, headers)

    def on_body(self, body: bytes) -> None:
        if body and not self._finished:
            self.exchange._on_body(body)

    def on_message_complete(self) -> None:
        if self._status >= 200 and not self._finished:
            self._finished = True


class UpstreamPool:
    """Keep-alive connections per instance (most recently used first) and the requests sent over them."""

    def __init__(self, connect_timeout_s: float, idle_timeout_s: float = 15.0, max_idle_per_instance: int = 1024,
                 unreachable_timeout_s: float = 30.0):
        self.connect_timeout_s = connect_timeout_s
        self.unreachable_timeout_s = unreachable_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_idle = max_idle_per_instance
        self.idle: dict[str, deque[_Connection]] = {}
        self.origins: dict[str, Origin] = {}
        self.connecting: set[asyncio.Task] = set()
        self.opened = 0  # connections opened so far (tests and /metrics-style introspection)

    def send(self, base_url: str, path: str, fields: bytes, body: bytes, whole: bool) -> Exchange:
        """POSTs `body` to `base_url + path` with the header lines `fields` (each ending in CRLF, no Host or
        Content-Length): at once over an idle connection, else from a task that opens one."""
        loop = asyncio.get_running_loop()
        origin = self.origins.get(base_url)
        if origin is None:
            origin = self.origins[base_url] = Origin(base_url)
        head = b"".join((b"POST ", path.encode(), b" HTTP/1.1\r\n", origin.host_line, _FIXED_FIELDS,
                         b"Content-Length: ", str(len(body)).encode(), b"\r\n", fields, b"\r\n"))
        exchange = Exchange(loop, whole)
        conn = self._idle(base_url)
        if conn is not None:
            conn.start(exchange, head, body)
        else:
            task = loop.create_task(self._connect_and_start(base_url, origin, exchange, head, body))
            exchange.connect_task = task
            self.connecting.add(task)
            task.add_done_callback(self.connecting.discard)
        return exchange

    def _idle(self, key: str) -> _Connection | None:
        idle = self.idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and not conn.transport.is_closing() and now - conn.idle_since < self.idle_timeout_s:
                return conn
            conn.close()
        return None

    def _release(self, conn: _Connection) -> None:
        idle = self.idle.get(conn.key)
        if idle is None:
            idle = self.idle[conn.key] = deque()
        now = time.monotonic()
        conn.idle_since = now
        idle.append(conn)
        while idle and (len(idle) > self.max_idle or now - idle[0].idle_since >= self.idle_timeout_s):
            idle.popleft().close()

    async def _connect_and_start(self, key: str, origin: Origin, exchange: Exchange, head: bytes,
                                 body: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(self, key), origin.host, origin.port,
                                                       ssl=origin.ssl, server_hostname=origin.server_hostname)
        except (OSError, asyncio.TimeoutError) as exc:
            what = f"timed out after {self.connect_timeout_s:g} s" if isinstance(exc, asyncio.TimeoutError) else exc
            exchange._fail(UpstreamConnectionError(f"cannot connect to {key}: {what}"))
            return
        self.opened += 1
        if exchange.closed:
            self._release(conn)  # given up while connecting; the connection is still good
            return
        conn.start(exchange, head, body)

    def forget(self, base_url: str) -> None:
        """Closes the idle connections to an instance that left the registry."""
        self.origins.pop(base_url, None)
        for conn in self.idle.pop(base_url, ()):
            conn.close()

    async def close(self) -> None:
        for task in list(self.connecting):
            task.cancel()
        await asyncio.gather(*self.connecting, return_exceptions=True)
        for idle in self.idle.values():
            while idle:
                idle.pop().close()
