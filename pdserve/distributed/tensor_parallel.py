"""The tensor-parallel group of one server: collectives through torch.distributed, NCCL on GPUs and gloo on
CPU (one code path). Rank 0 also broadcasts the scheduler's messages to the other ranks over a gloo group,
so every rank runs the same scheduler on the same input and forms the same batches.

Leaving the group is collective: NCCL's teardown waits for every rank of the communicator, so a rank that destroys
it while a peer is gone, or still waits in a collective, hangs. The leader closes the group (`close`); the
followers learn it from the message broadcast they wait in, and all ranks finish their device work, meet within
CLOSE_TIMEOUT and destroy together. A rank that cannot meet the others aborts the group instead, which needs no
peer. A server's ranks never leave: they exit without interpreter teardown (`process_setup.exit_now`).

A follower that dies while the group forms or the engine starts must not leave rank 0 waiting out a timeout. In a
server, the main process watches every rank's process and stops the server. The offline `LLM` is rank 0 itself: it
starts under a `FollowerWatch`, which the rendezvous polls and which aborts an NCCL group (a collective waiting for a
dead peer never ends on its own; gloo's fails as the peer's sockets close), so that the start fails at once with an
error naming the dead rank and its exit code."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import msgpack
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# A rank waits this long in a collective before it gives up: longer than any forward pass, idle poll or a peer's
# model load and warm-up between two collectives.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# The ranks all join within this long of each other: each joins before it loads its shard.
RENDEZVOUS_TIMEOUT = timedelta(minutes=5)
# Closing the group: the followers see the leader's close and meet it within this long, or it aborts the group.
CLOSE_TIMEOUT = timedelta(seconds=60)
_CLOSE = -1  # the length `broadcast_bytes` sends to close the group instead of a payload's
_JOINED = "pdserve/tp_joined"  # the rendezvous's count of the ranks that reached the store
WATCH_INTERVAL_S = 0.2  # how often the rendezvous counts and the follower watch looks at the processes
# After a collective failed, how long rank 0 waits for a follower's exit to be seen (its sockets close first).
DEATH_GRACE_S = 2.0


class GroupClosed(Exception):
    """Raised on a follower rank, by the broadcast it waited in, once the leader has closed the group and this rank
    has left it: the follower's work is over."""


@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    device_group: Any = None  # tensors of the forward pass
    cpu_group: Any = None  # the leader's messages

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """The leader's `payload` on every rank (the others pass None)."""
        if self.size == 1:
            return payload or b""
        length = torch.tensor([len(payload) if self.is_leader else 0], dtype=torch.int64)
        dist.broadcast(length, src=0, group=self.cpu_group)
        if length.item() == _CLOSE:
            self._leave()
            raise GroupClosed(f"tensor-parallel rank {self.rank}: the leader closed the group")
        if length.item() == 0:
            return b""
        if self.is_leader:
            buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buffer = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.broadcast(buffer, src=0, group=self.cpu_group)
        return buffer.numpy().tobytes()

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's `payload`, in rank order, on every rank."""
        if self.size == 1:
            return [payload]
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(lengths, torch.tensor([len(payload)], dtype=torch.int64), group=self.cpu_group)
        longest = max(int(n.item()) for n in lengths)
        if longest == 0:
            return [b""] * self.size
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else mine[:0]
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.cpu_group)
        return [p[: int(n.item())].numpy().tobytes() for p, n in zip(parts, lengths)]

    def min_over_ranks(self, value: int) -> int:
        """The smallest of the ranks' `value`s, so that sizes measured per rank agree."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(tensor.item())

    def broadcast_messages(self, raws: list[bytes] | None) -> list[bytes]:
        """The leader's encoded messages on every rank (the others pass None)."""
        if self.size == 1:
            return raws or []
        payload = msgpack.packb(raws, use_bin_type=True) if raws else b""  # nothing new: one collective
        received = self.broadcast_bytes(payload if self.is_leader else None)
        return msgpack.unpackb(received, raw=False) if received else []

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.cpu_group)

    def close(self) -> None:
        """Leader: end the followers' broadcast wait with a close, then leave the group with them, so that this
        process can form another one. Does nothing once the group is gone; aborts it if a follower does not
        answer within CLOSE_TIMEOUT."""
        if self.size == 1 or not dist.is_initialized():
            return
        assert self.is_leader, "only the leader closes the group; the followers leave when they see it"
        try:
            close = torch.tensor([_CLOSE], dtype=torch.int64)
            dist.broadcast(close, src=0, group=self.cpu_group, async_op=True).wait(timeout=CLOSE_TIMEOUT)
        except RuntimeError as exc:  # gloo's errors and timeouts, DistBackendError among them
            logger.error("tensor-parallel group: a follower did not take the close (%s); aborting the group", exc)
            abort_group()
            return
        self._leave()

    def _leave(self) -> None:
        """Every rank at once: no collective left on the device, meet, destroy; abort if the others do not come."""
        if self.device_group is not self.cpu_group:
            torch.cuda.synchronize()  # NCCL's kernels of this rank all done before its communicator goes
        try:
            dist.monitored_barrier(group=self.cpu_group, timeout=CLOSE_TIMEOUT, wait_all_ranks=True)
        except RuntimeError as exc:
            logger.error("tensor-parallel rank %d: the group did not meet to close (%s); aborting it", self.rank, exc)
            abort_group()
            return
        dist.destroy_process_group()


def abort_group() -> None:
    """Drop the process group without its peers (NCCL's abort, where destroy would wait for every rank)."""
    if not dist.is_initialized():
        return
    try:
        dist.distributed_c10d._abort_process_group()
    except (RuntimeError, NotImplementedError) as exc:  # a backend without abort (gloo): its teardown needs no peer
        logger.warning("tensor-parallel group: abort unsupported (%s); destroying it", exc)
        dist.destroy_process_group()


class FollowerDied(RuntimeError):
    """Rank 0's start failed because a follower rank's process exited."""


class FollowerWatch:
    """Rank 0's watch over its followers' processes (rank i + 1 is `followers[i]`) while the group forms and the engine
    starts, as a context: the rendezvous asks it (`check`) between its polls; a thread aborts an NCCL group as soon as
    a follower is gone. An error leaving the context becomes `FollowerDied`, naming the rank and its exit code, when
    a follower was gone first, or it is a RuntimeError (a collective's) and a follower is seen gone within
    DEATH_GRACE_S; rank 0's own errors (a ConfigError) stay as they are. One watch at a time, in the main thread."""

    def __init__(self, followers: Sequence[BaseProcess]):
        self.followers = list(followers)
        self.seen: str | None = None  # the death the watch thread saw
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tp-follower-watch", daemon=True)

    def death(self) -> str | None:
        """The first follower that exited, in words; None while all live."""
        for rank, process in enumerate(self.followers, start=1):
            if process.exitcode is not None:
                return (f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode} while "
                        "the group formed or the engine started; its log says why")
        return None

    def check(self) -> None:
        if (death := self.death()) is not None:
            raise FollowerDied(death)

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            death = self.death()
            if death is not None:
                self.seen = death
                logger.error("%s; leaving the group", death)
                if dist.is_initialized() and dist.get_backend() == "nccl":
                    abort_group()  # ends rank 0's wait in a collective with the dead rank
                return

    def _cause_of(self, exc: BaseException) -> str | None:
        if self.seen is not None or isinstance(exc, FollowerDied) or not isinstance(exc, RuntimeError):
            return self.seen
        deadline = time.monotonic() + DEATH_GRACE_S
        while (death := self.death()) is None and time.monotonic() < deadline:
            time.sleep(WATCH_INTERVAL_S / 4)
        return death

    def __enter__(self) -> "FollowerWatch":
        global _watch
        assert _watch is None, "one follower watch at a time"
        _watch = self
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        global _watch
        _watch = None
        self._stop.set()
        self._thread.join()
        if exc is not None and (death := self._cause_of(exc)) is not None:
            raise FollowerDied(death) from exc


_watch: FollowerWatch | None = None  # the watch rank 0 starts under, if any (the offline LLM's)


def init_tp_group(size: int, rank: int, port: int | None, device: torch.device) -> TPGroup:
    """Join the group of `size` ranks rendezvousing on 127.0.0.1:`port` within RENDEZVOUS_TIMEOUT; size 1 needs no
    group."""
    if size == 1:
        return TPGroup()
    if port is None:
        raise ValueError("tensor parallelism needs the rendezvous port (--nccl-port); the launcher sets it")
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=RENDEZVOUS_TIMEOUT,
                              wait_for_workers=False)
        _meet(store, size)
    except FollowerDied:
        raise
    except (RuntimeError, TimeoutError) as exc:  # DistStoreError: a peer never came, or the port is taken
        raise RuntimeError(f"tensor-parallel rank {rank} of {size}: the group did not form on 127.0.0.1:{port} "
                           f"within {RENDEZVOUS_TIMEOUT} (a rank failed to start?): {exc}") from exc
    dist.init_process_group(backend, store=store, world_size=size, rank=rank, timeout=COLLECTIVE_TIMEOUT)
    world = dist.group.WORLD
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return TPGroup(rank, size, world, cpu_group)


def _meet(store: dist.TCPStore, size: int) -> None:
    """Count this rank in and wait for all `size`, within RENDEZVOUS_TIMEOUT; the watch, if any, is asked between
    polls, so a follower that died before it came ends the wait at once."""
    store.add(_JOINED, 1)
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT.total_seconds()
    while store.add(_JOINED, 0) < size:
        if _watch is not None:
            _watch.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{store.add(_JOINED, 0)} of {size} ranks came")
        time.sleep(WATCH_INTERVAL_S)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads split across ranks, each replicated on tp_size / num_kv_heads ranks when there are fewer."""
    return max(1, num_kv_heads // tp_size)


def kv_head_start(num_kv_heads: int, tp_size: int, rank: int) -> int:
    """The first KV head rank `rank` holds."""
    if num_kv_heads >= tp_size:
        return rank * (num_kv_heads // tp_size)
    return rank * num_kv_heads // tp_size
