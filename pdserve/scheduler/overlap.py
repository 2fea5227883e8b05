"""Overlap scheduling: launch decode step N+1 while step N's sampled tokens are still on the device, then read N back.

The CPU work of reading a step back (appending tokens, stop checks, outputs) and of preparing the next one then
runs while the GPU computes. Greedy and sampled requests take part when the batch's device sampling tensors alone
sample them (greedy and temperature-only batches inside the decode CUDA graph, `ModelRunner.decode_tokens`); a batch
with host-side sampling state (penalties, a seed, logprobs, pending min_tokens) decodes synchronously. A batch with
a grammar launches its forward, reads step N back while it runs (the matchers take N's tokens), fills its token
bitmask on the CPU, then masks and samples on the device. Pages of a request that ends while a launched batch still
writes its KV are freed once that batch has been read back.

The scheduler launches and reads back (`Scheduler._launch_overlapped`, `_read_back`); this module holds the batch in
flight and the device-side helpers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from pdserve.forward_batch import to_device
from pdserve.scheduler.request import Req


@dataclass(slots=True, eq=False)
class InflightDecode:
    """A decode batch launched but not yet read back (overlap scheduling); a constrained batch is in flight from its
    forward's launch, before its tokens are sampled."""

    reqs: list[Req]
    req_ids: frozenset[int]  # id() of each request in `reqs`
    tokens: torch.Tensor | None = None  # sampled tokens, on the device
    host_tokens: torch.Tensor | None = None  # their host copy, valid once `done` has completed
    done: torch.cuda.Event | None = None
    deferred_pages: list[int] = field(default_factory=list)  # freed once this batch has been read back

    def sampled(self, tokens: torch.Tensor, copier: HostCopier) -> None:
        self.tokens = tokens
        self.host_tokens, self.done = copier.copy(tokens)


def _copy_rows(input_ids: torch.Tensor, dst: torch.Tensor, tokens: torch.Tensor, src: torch.Tensor) -> None:
    """input_ids[dst[i]] = tokens[src[i]], on the device: the previous step's samples become this step's inputs."""
    input_ids.index_copy_(0, dst, tokens.index_select(0, src))


def decode_inputs(prev: InflightDecode | None, reqs: list[Req], device: torch.device):
    """The input ids known on the host (0 where the previous batch's token is still on the device) and a
    callback that writes the previous batch's tokens into the device input ids (None without one)."""
    if prev is None:
        return [r.output_ids[-1] for r in reqs], None
    if prev.reqs == reqs:  # the same batch again: row i continues row i
        return [0] * len(reqs), lambda input_ids: input_ids.copy_(prev.tokens)
    ahead = prev.req_ids
    return [0 if id(r) in ahead else r.output_ids[-1] for r in reqs], _fix_rows(prev, reqs, device)


def _fix_rows(prev: InflightDecode, reqs: list[Req], device: torch.device):
    """A callback that writes the previous batch's tokens into the rows of this batch that continue them."""
    prev_row = {id(r): i for i, r in enumerate(prev.reqs)}
    rows = [(i, prev_row[id(r)]) for i, r in enumerate(reqs) if id(r) in prev.req_ids]
    idx = to_device([i for i, _ in rows] + [j for _, j in rows], torch.int64, device).view(2, -1)
    return partial(_copy_rows, dst=idx[0], tokens=prev.tokens, src=idx[1])


class HostCopier:
    """Copies sampled tokens to the host without a sync: two pinned buffers, since the previous batch's copy is
    still being read while the next one is written."""

    __slots__ = ("max_rows", "_pinned")

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self._pinned: list[torch.Tensor] = []

    def copy(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The host copy of `tokens` and the event after which it is valid (None: valid now, on a CPU)."""
        if tokens.device.type != "cuda":
            return tokens, None
        if not self._pinned:
            self._pinned = [torch.empty(self.max_rows, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._pinned.reverse()
        host = self._pinned[0][: tokens.shape[0]]
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done
