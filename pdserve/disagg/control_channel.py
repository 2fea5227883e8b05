"""The control channel of a PD server: peers' messages arrive on a background thread, the scheduler reads them.

Every message from a peer is checked (its cluster-secret signature when one is configured, then its schema,
see control_messages) on the receiving thread; a bad one is logged and dropped there, so handlers only ever
see well-formed typed messages.

Two queues, never mixed: `from_peers` (what other servers sent: `remote` messages only) and `completions` (what this
process's helper threads finished: KV writes, route lookups, heartbeat verdicts; in-process messages only). Each
entry carries the time it became known here, so a handler records a stage when it happened, not when the
scheduler's next step reads it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

import zmq

from pdserve.cluster_auth import ClusterAuth
from pdserve.disagg.control_messages import Message, from_wire, to_wire
from pdserve.disagg.transfer.base import TransferError
from pdserve.disagg.control_transport import ControlServer, PeerClients

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 << 20  # a transfer_request for a million pages is ~5 MB


@dataclass(frozen=True, slots=True)
class Known:
    """A control message and `at`, the time.monotonic() when it became known here: when the control thread took a
    peer's off the wire, when a helper thread finished its work."""

    msg: Message
    at: float


@dataclass(frozen=True, slots=True)
class Drained:
    """What the scheduler thread takes from the channel at one step, each queue oldest first."""

    from_peers: list[Known]
    completions: list[Known]


class ControlChannel:
    """Receives control messages on a background thread into `from_peers`; takes helper threads' results into
    `completions`; sends fire-and-forget to peers.

    Every message queued also makes `wakeup_fd` readable, so the scheduler process can sleep on
    its request socket and this fd together instead of polling. A tensor-parallel follower rank's channel does
    not `listen`: peers talk to the leader only, and it holds its own threads' completions alone.
    """

    def __init__(self, host: str, name: str, auth: ClusterAuth | None = None, listen: bool = True):
        self.auth = auth
        self.from_peers: queue.SimpleQueue[Known] = queue.SimpleQueue()
        self.completions: queue.SimpleQueue[Known] = queue.SimpleQueue()
        self.wakeup_fd, self._wakeup_write_fd = os.pipe()
        os.set_blocking(self.wakeup_fd, False)
        os.set_blocking(self._wakeup_write_fd, False)
        self._wakeup_lock = threading.Lock()  # a late wake-up (a route lookup ending) never writes to a closed fd
        self._closed = False
        self.server = ControlServer(host, 0, self._on_message, name, auth, MAX_MESSAGE_BYTES) if listen else None
        self.endpoint = self.server.endpoint if listen else ""
        self.peers = self.new_peer_clients()  # used from the scheduler thread only

    def new_peer_clients(self) -> PeerClients:
        """Clients that sign what they send with the cluster secret (one set per sending thread)."""
        return PeerClients(timeout_s=5.0, auth=self.auth)

    def _on_message(self, header: dict, frames, reply) -> None:
        msg = from_wire(header, remote=True)  # a ControlMessageError is logged and dropped by the server
        self.from_peers.put(Known(msg, time.monotonic()))
        self.wake()

    def complete(self, msg: Message) -> None:
        """A helper thread's result for the scheduler thread (from any thread); wakes it. Only in-process messages:
        a peer's message comes through the control server alone."""
        if msg.remote:
            raise TypeError(f"{msg.tag} is a peer's message, not a completion")
        self.completions.put(Known(msg, time.monotonic()))
        self.wake()

    def wake(self) -> None:
        with self._wakeup_lock:
            if self._closed:
                return
            try:
                os.write(self._wakeup_write_fd, b"\0")
            except BlockingIOError:  # the pipe is full of unread wake-ups: the scheduler is awake anyway
                pass

    def send(self, endpoint: str, msg: Message) -> None:
        """Fire and forget; an endpoint a peer gave us that cannot be reached is logged, never raised."""
        try:
            self.peers.get(endpoint).send(to_wire(msg))
        except (TransferError, zmq.ZMQError) as exc:
            logger.warning("cannot send %s to %r: %s", msg.tag, endpoint, exc)
            self.peers.drop(endpoint)

    def drain(self) -> Drained:
        try:
            while os.read(self.wakeup_fd, 4096):
                pass
        except BlockingIOError:
            pass
        return Drained(_take_all(self.from_peers), _take_all(self.completions))

    def close(self) -> None:
        self.peers.close()
        if self.server is not None:
            self.server.close()
        with self._wakeup_lock:
            self._closed = True
            os.close(self.wakeup_fd)
            os.close(self._wakeup_write_fd)



def _take_all(q: queue.SimpleQueue[Known]) -> list[Known]:
    taken = []
    try:
        while True:
            taken.append(q.get_nowait())
    except queue.Empty:
        return taken
