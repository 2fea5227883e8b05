"""Overlap scheduling: launch decode step N+1 while step N's sampled tokens are still on the device, then read N back.

The CPU work of reading a step back (appending tokens, stop checks, outputs) and of preparing the next one then
runs while the GPU computes. Greedy and sampled requests take part when the batch's device sampling tensors alone
sample them (greedy and temperature-only batches inside the decode CUDA graph, `ModelRunner.decode_tokens`); a batch
with host-side sampling state (penalties, a seed, logprobs, pending min_tokens) decodes synchronously. Pages of a
request that ends while a launched batch still writes its KV are freed once that batch has been read back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from pdserve.forward_batch import to_device
from pdserve.scheduler.request import Req


@dataclass(slots=True, eq=False)
class InflightDecode:
    """A decode batch launched but not yet read back (overlap scheduling)."""

    reqs: list[Req]
    tokens: torch.Tensor  # sampled tokens, on the device
    host_tokens: torch.Tensor  # their host copy, valid once `done` has completed
    done: torch.cuda.Event | None
    req_ids: frozenset[int]  # id() of each request in `reqs`
    deferred_pages: list[int] = field(default_factory=list)  # freed once this batch has been read back


def _copy_rows(input_ids: torch.Tensor, dst: torch.Tensor, tokens: torch.Tensor, src: torch.Tensor) -> None:
    """input_ids[dst[i]] = tokens[src[i]], on the device: the previous step's samples become this step's inputs."""
    input_ids.index_copy_(0, dst, tokens.index_select(0, src))


class OverlapMixin:
    """Mixed into `Scheduler`; uses its running list, page helpers, sampler and finish logic."""

    def _launch_overlapped(self) -> bool:
        """Launch a decode batch whose inputs may still be on the device; then read back the previous batch.
        Returns False (nothing launched) when a request needs host-side sampling state or KV runs short."""
        reqs = list(self.running)
        state = self._input_batch_of(reqs)
        if not state.device_sampling_only():
            return False
        positions = [r.num_cached_tokens for r in reqs]  # rows still in flight included: their KV is on its way
        if not self._ensure_decode_pages(reqs, positions):
            return False
        prev = self.inflight
        input_ids, fix_ids = self._decode_inputs(prev, reqs)
        tokens = self._device_tokens(state, self._decode_batch(state, positions, input_ids, fix_ids))
        self.inflight = InflightDecode(reqs, tokens, *self._copy_to_host(tokens), req_ids=state.req_ids)
        if prev is not None:
            self._read_back(prev)
        return True

    def _ensure_decode_pages(self, reqs: list[Req], positions: list[int]) -> bool:
        """A KV slot at every request's position; only requests whose last page is full get a new one."""
        ps = self.page_size
        full = [(r, p) for r, p in zip(reqs, positions) if p >= len(r.pages) * ps]
        return all(self._ensure_pages(r, p + 1) for r, p in full)

    def _decode_inputs(self, prev: InflightDecode | None, reqs: list[Req]):
        """The input ids known on the host (0 where the previous batch's token is still on the device) and a
        callback that writes the previous batch's tokens into the device input ids (None without one)."""
        if prev is None:
            return [r.output_ids[-1] for r in reqs], None
        if prev.reqs == reqs:  # the same batch again: row i continues row i
            return [0] * len(reqs), lambda input_ids: input_ids.copy_(prev.tokens)
        ahead = prev.req_ids
        return [0 if id(r) in ahead else r.output_ids[-1] for r in reqs], self._fix_rows(prev, reqs)

    def _fix_rows(self, prev: InflightDecode, reqs: list[Req]):
        """A callback that writes the previous batch's tokens into the rows of this batch that continue them."""
        prev_row = {id(r): i for i, r in enumerate(prev.reqs)}
        rows = [(i, prev_row[id(r)]) for i, r in enumerate(reqs) if id(r) in prev.req_ids]
        idx = to_device([i for i, _ in rows] + [j for _, j in rows], torch.int64, self.device).view(2, -1)
        return partial(_copy_rows, dst=idx[0], tokens=prev.tokens, src=idx[1])

    def _copy_to_host(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if tokens.device.type != "cuda":
            return tokens, None
        if not self._pinned:
            size = self.args.max_running_requests
            self._pinned = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._pinned.reverse()  # double buffer: the previous batch's copy is still being read
        host = self._pinned[0][: tokens.shape[0]]
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def _finish_inflight(self) -> None:
        if self.inflight is not None:
            prev, self.inflight = self.inflight, None
            self._read_back(prev)

    def _read_back(self, batch: InflightDecode) -> None:
        if batch.done is not None:
            batch.done.synchronize()
        changed, check_stop = self._changed, self.check_stop
        for req, token in zip(batch.reqs, batch.host_tokens.tolist()):
            if req.finish_reason is not None:
                continue  # ended while the batch ran (stop, abort): its extra token is dropped
            req.output_ids.append(token)
            changed[req.rid] = req
            reason = check_stop(req)
            if reason is not None:
                self._finish(req, reason)
        self.running = [r for r in self.running if r.finish_reason is None]
        self.allocator.free(batch.deferred_pages)
