"""The tensor-parallel group of one server: collectives through torch.distributed, NCCL on GPUs and gloo on
CPU (one code path). Rank 0 also broadcasts the scheduler's messages to the other ranks over a gloo group,
so every rank runs the same scheduler on the same input and forms the same batches."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgpack
import torch
import torch.distributed as dist

# A rank waits this long in a collective before it gives up: longer than any forward pass or idle poll.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


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

    def destroy(self) -> None:
        """Leave the group, so that this process can form another one."""
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def init_tp_group(size: int, rank: int, port: int | None, device: torch.device) -> TPGroup:
    """Join the group of `size` ranks rendezvousing on 127.0.0.1:`port`; size 1 needs no group."""
    if size == 1:
        return TPGroup()
    if port is None:
        raise ValueError("tensor parallelism needs the rendezvous port (--nccl-port); the launcher sets it")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", world_size=size, rank=rank,
                            timeout=COLLECTIVE_TIMEOUT)
    world = dist.group.WORLD
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return TPGroup(rank, size, world, cpu_group)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads split across ranks, each replicated on tp_size / num_kv_heads ranks when there are fewer."""
    return max(1, num_kv_heads // tp_size)


def kv_head_start(num_kv_heads: int, tp_size: int, rank: int) -> int:
    """The first KV head rank `rank` holds."""
    if num_kv_heads >= tp_size:
        return rank * (num_kv_heads // tp_size)
    return rank * num_kv_heads // tp_size
