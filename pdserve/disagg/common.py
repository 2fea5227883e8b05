"""What both PD roles share: the handoff poll state, the control channel, and the KV-manager base.

Control messages (msgpack dicts over ZMQ, keyed by `bootstrap_room`):
  decode -> prefill  transfer_request {room, rid, control, session, peer: describe(), dst_pages}
  prefill -> decode  kv_done {room, rid, aux: {room, first_token, logprob, top_logprobs}}
  either way         failed {room, error}, abort {room}
  prefill -> decode  abort_ack {room}  (no write for the room is in flight any more)
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from pdserve.config import ServerArgs
from pdserve.disagg.addressing import announced_host
from pdserve.disagg.transfer import KVRegion, make_transfer_engine
from pdserve.disagg.transfer.channel import ControlServer, PeerClients
from pdserve.mem_cache.kv_pool import KVPool
from pdserve.models.model_config import ModelConfig
from pdserve.scheduler.request import Req

logger = logging.getLogger(__name__)

MAX_PAGES_PER_MESSAGE = 1 << 20
PEER_FAILED = 502  # HTTP status of a request whose handoff failed at or with the peer (the router may retry it)
PEER_TIMEOUT = 504  # ... or timed out waiting for the peer
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's marker: a PD request that moves no KV (health checks, warm-up)


class KVPoll(IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


@dataclass(slots=True, eq=False)
class Handoff:
    """One request's KV handoff on either side. The state only moves forward; FAILED dominates."""

    req: Req
    room: int
    deadline: float
    poll: KVPoll = KVPoll.BOOTSTRAPPING
    error: str | None = None
    peer_control: str | None = None  # the other side's control endpoint
    peer_session: str | None = None  # the other side's transfer-engine session
    peer_region: KVRegion | None = None
    dst_pages: list[int] = field(default_factory=list)
    pages_sent: int = 0
    writes_in_flight: int = 0

    def advance(self, state: KVPoll, error: str | None = None) -> None:
        if self.poll == KVPoll.FAILED:
            return
        if state == KVPoll.FAILED:
            self.poll, self.error = KVPoll.FAILED, error
        elif state > self.poll:
            self.poll = state


def model_fingerprint(cfg: ModelConfig) -> str:
    return (f"{cfg.architecture} layers={cfg.num_layers} hidden={cfg.hidden_size} heads={cfg.num_heads}/"
            f"{cfg.num_kv_heads} vocab={cfg.vocab_size}")


def peer_description(args: ServerArgs, cfg: ModelConfig, pool: KVPool, backend: str) -> dict:
    """The fields both sides must agree on (see bootstrap.check_compatible)."""
    return {"model": model_fingerprint(cfg), "tp_size": args.tp_size, "transfer_backend": backend,
            "kv_layout": pool.layout.describe()}


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


class KVManager:
    """Owns the transfer engine (KV buffer registered once) and the control channel of one PD server."""

    def __init__(self, args: ServerArgs, cfg: ModelConfig, pool: KVPool, device: torch.device):
        self.args = args
        self.pool = pool
        self.device = device
        self.engine = make_transfer_engine(
            args.disaggregation_transfer_backend, str(device), args.disaggregation_ib_device, host=args.host,
            timeout_s=args.disaggregation_waiting_timeout,
            advertise_host=announced_host(args.host, args.disaggregation_advertise_host),
        )
        self.engine.register(pool.data_ptr, pool.nbytes, str(device))
        self.region = KVRegion(pool.data_ptr, pool.layout)
        self.channel = ControlChannel(args.host, f"pd-{args.disaggregation_mode}")
        self.description = peer_description(args, cfg, pool, self.engine.name)
        logger.info("KV transfer backend %s over %s; control endpoint %s", self.engine.name,
                    self.engine.transport(), self.channel.endpoint)

    def info(self) -> dict:
        return {"transfer_backend": self.engine.name, "transport": self.engine.transport(),
                "session": self.engine.session_id(), "control_endpoint": self.channel.endpoint}

    def close(self) -> None:
        self.channel.close()
        self.engine.close()


def checked_pages(value, limit: int, expected: int) -> list[int]:
    """Page ids from another process: a list of `expected` distinct ints in [1, limit)."""
    if not isinstance(value, list) or len(value) != expected or expected > MAX_PAGES_PER_MESSAGE:
        raise ValueError(f"expected {expected} destination pages, got {type(value).__name__} of "
                         f"{len(value) if isinstance(value, list) else '?'}")
    if not all(type(p) is int and 1 <= p < limit for p in value) or len(set(value)) != len(value):
        raise ValueError(f"destination pages must be distinct ints in [1, {limit})")
    return value


def now() -> float:
    return time.monotonic()
