"""The control channel of a PD server: peers' messages arrive on a background thread, the scheduler reads them."""

from __future__ import annotations

import logging
import os
import queue
import threading

from pdserve.disagg.transfer.channel import ControlServer, PeerClients

logger = logging.getLogger(__name__)


class ControlChannel:
    """Receives control messages on a background thread into a queue; sends fire-and-forget to peers.

    Every message posted to the inbox also makes `wakeup_fd` readable, so the scheduler process can sleep on
    its request socket and this fd together instead of polling.
    """

    def __init__(self, host: str, name: str):
        self.inbox: queue.SimpleQueue[dict] = queue.SimpleQueue()
        self.wakeup_fd, self._wakeup_write_fd = os.pipe()
        os.set_blocking(self.wakeup_fd, False)
        os.set_blocking(self._wakeup_write_fd, False)
        self._wakeup_lock = threading.Lock()  # a late wake-up (a route lookup ending) never writes to a closed fd
        self._closed = False
        self.server = ControlServer(host, 0, self._on_message, name)
        self.endpoint = self.server.endpoint
        self.peers = PeerClients(timeout_s=5.0)  # used from the scheduler thread only

    def _on_message(self, header: dict, frames, reply) -> None:
        if not isinstance(header.get("type"), str) or not isinstance(header.get("room"), int):
            raise ValueError(f"control message without type/room: {sorted(header)}")
        self.post(header)

    def post(self, msg: dict) -> None:
        """Queue a message for the scheduler thread (from any thread) and wake it."""
        self.inbox.put(msg)
        self.wake()

    def wake(self) -> None:
        with self._wakeup_lock:
            if self._closed:
                return
            try:
                os.write(self._wakeup_write_fd, b"\0")
            except BlockingIOError:  # the pipe is full of unread wake-ups: the scheduler is awake anyway
                pass

    def send(self, endpoint: str, msg: dict) -> None:
        self.peers.get(endpoint).send(msg)

    def dispatch(self, handlers: dict) -> None:
        """Run the handler of every queued message."""
        for msg in self.drain():
            handler = handlers.get(msg["type"])
            if handler is None:
                logger.warning("ignoring unknown control message %r", msg["type"])
                continue
            handler(msg)

    def drain(self) -> list[dict]:
        try:
            while os.read(self.wakeup_fd, 4096):
                pass
        except BlockingIOError:
            pass
        msgs = []
        try:
            while True:
                msgs.append(self.inbox.get_nowait())
        except queue.Empty:
            return msgs

    def close(self) -> None:
        self.peers.close()
        self.server.close()
        with self._wakeup_lock:
            self._closed = True
            os.close(self.wakeup_fd)
            os.close(self._wakeup_write_fd)

