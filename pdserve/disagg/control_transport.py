"""The request/reply transport under the PD control channel (`control_channel.py`), also used by the tcp and nccl
engines for their own control messages.

Wire format (ZMQ multipart, never pickle): frame 0 is a msgpack header dict, further frames are raw
payload. With a cluster secret (`auth`), every header a client sends is signed and the server refuses
any header whose signature does not verify before its handler sees it. The server is a ROUTER socket served by one thread; a handler gets (header, payload frames,
reply) and may call `reply(dict)` more than once (nccl answers "ready" before posting receives, then
"done"). The client is one DEALER socket per peer, used from one thread.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable

import msgpack
import zmq

from pdserve.cluster_auth import ClusterAuth
from pdserve.disagg.transfer.base import TransferError

logger = logging.getLogger(__name__)

Reply = Callable[[dict], None]
Handler = Callable[[dict, list[zmq.Frame], Reply], None]

_POLL_MS = 100
_PEER_PROBE_MS = 500  # a reply wait checks this often that the peer still listens


class ControlServer:
    def __init__(self, host: str, port: int, handler: Handler, name: str, auth: ClusterAuth | None = None,
                 max_message_bytes: int = -1):
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IPV6, ":" in host)  # "::" listens on IPv4 and IPv6
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # a larger frame drops the sender's connection
        self._auth = auth
        try:
            if port == 0:
                port = self._sock.bind_to_random_port(f"tcp://{host}")
            else:
                self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self._sock.close()
            raise TransferError(f"cannot bind {name} control socket on {host}:{port}: {exc}") from exc
        self.endpoint = f"{host}:{port}"
        self._handler = handler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"{name}-recv-{port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(_POLL_MS, zmq.POLLIN):
                    self._serve_one(self._sock.recv_multipart(copy=False))
        finally:
            self._sock.close()

    def _serve_one(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes

        def reply(msg: dict) -> None:
            self._sock.send_multipart([identity, msgpack.packb(msg)])

        try:
            if len(frames) < 2:
                raise TransferError("message without a header frame")
            header = msgpack.unpackb(frames[1].buffer, raw=False)
            if not isinstance(header, dict):
                raise TransferError("header is not a map")
            if self._auth is not None:
                header = self._auth.verify(header)
            self._handler(header, frames[2:], reply)
        except Exception as exc:  # a bad message fails that request, never the server thread
            logger.warning("refused control message: %s", exc)
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


class ControlClient:
    def __init__(self, endpoint: str, timeout_s: float, auth: ClusterAuth | None = None):
        if not isinstance(endpoint, str) or endpoint.count(":") != 1:
            raise TransferError(f"peer session {endpoint!r} is not host:port")
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._auth = auth
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"tcp://{endpoint}")

    def send(self, header: dict, payload: list = (), copy: bool = True) -> None:
        if self._auth is not None:
            header = self._auth.sign(header)
        self._sock.send_multipart([msgpack.packb(header), *payload], copy=copy)

    def recv(self, what: str) -> dict:
        """The next reply; raises TransferError on timeout, on an error reply, or as soon as nothing listens on
        the peer's port any more (a dead peer, not a slow or frozen one: ZMQ alone would wait out the timeout)."""
        deadline = time.monotonic() + self.timeout_s
        while not self._sock.poll(_PEER_PROBE_MS, zmq.POLLIN):
            if time.monotonic() > deadline:
                raise TransferError(f"no {what} from {self.endpoint} within {self.timeout_s:.0f}s")
            if not self._peer_listening():
                raise TransferError(f"no {what} from {self.endpoint}: nothing listens there any more")
        msg = msgpack.unpackb(self._sock.recv(), raw=False)
        if not isinstance(msg, dict) or not msg.get("ok"):
            error = msg.get("error") if isinstance(msg, dict) else msg
            raise TransferError(f"{self.endpoint} refused the {what}: {error}")
        return msg

    def _peer_listening(self) -> bool:
        host, port = self.endpoint.rsplit(":", 1)
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=_PEER_PROBE_MS / 1000).close()
        except ConnectionRefusedError:
            return False
        except OSError:  # unreachable or slow to answer: not proof of death, the timeout decides
            pass
        return True

    def close(self) -> None:
        self._sock.close()


class PeerClients:
    """One ControlClient per peer session. A client that saw an error is dropped, so a late reply to a
    timed-out request can never be read as the answer to the next one."""

    def __init__(self, timeout_s: float, auth: ClusterAuth | None = None):
        self.timeout_s = timeout_s
        self.auth = auth
        self._clients: dict[str, ControlClient] = {}

    def get(self, peer_session: str) -> ControlClient:
        client = self._clients.get(peer_session)
        if client is None:
            client = self._clients[peer_session] = ControlClient(peer_session, self.timeout_s, self.auth)
        return client

    def drop(self, peer_session: str) -> None:
        client = self._clients.pop(peer_session, None)
        if client is not None:
            client.close()

    def close(self) -> None:
        for session in list(self._clients):
            self.drop(session)


def parse_spans(header: dict, key: str = "dst", width: int = 2) -> list[tuple[int, ...]]:
    """The header's list of spans: [ptr, length] each, or `width` ints each."""
    spans = header.get(key)
    if not isinstance(spans, list):
        raise TransferError(f"header field {key!r} must be a list of spans of {width} ints")
    out = []
    for span in spans:
        if not (isinstance(span, list) and len(span) == width and all(type(x) is int for x in span)):
            raise TransferError(f"malformed span {span!r}")
        out.append(tuple(span))
    return out
