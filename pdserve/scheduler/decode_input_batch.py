"""The persistent decode batch (`DecodeInputBatch`, after vLLM's persistent `InputBatch`): what the running requests
need on the device, kept across steps.

Built when the decode batch's composition changes (a request joins, ends or is retracted); otherwise a step
uploads only what changes (input ids, positions, KV slots, lengths, and the pages appended since the previous
step, patched into the device page table): two small host-to-device copies, no page-table rebuild, no
sampling-parameter upload.
"""

from __future__ import annotations

import torch

from pdserve.engine.sampler import SamplingRow, SamplingTensors
from pdserve.forward_batch import ForwardBatch, ForwardMode, flat_page_table, packed_to_device, to_device
from pdserve.scheduler.request import Req


class DecodeInputBatch:
    def __init__(self, reqs: list[Req], page_size: int, max_pages: int, device: torch.device):
        self.reqs = list(reqs)
        self.req_ids = frozenset(id(r) for r in reqs)
        self.page_size = page_size
        self.max_pages = max_pages
        self.device = device
        self._pages = [r.pages for r in reqs]  # the lists themselves: a request given new ones forces a rebuild
        self._num_pages = [len(p) for p in self._pages]  # pages already in the device table, per row
        width = max(self._num_pages, default=1) or 1
        self.page_table = to_device(flat_page_table(self._pages, width), torch.int32, device).view(len(reqs), width)
        n = len(reqs)
        self.extend_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.extend_start_loc = torch.arange(n, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=device)
        self.sampling = SamplingTensors.of([r.sampling_params for r in reqs], device)
        self.plain_rows = [SamplingRow(r.sampling_params, r.input_ids, r.output_ids, [], None) for r in reqs]
        self._host_sampling = any(_needs_host_sampling(r) for r in reqs)
        self.constrained = any(r.grammar is not None for r in reqs)  # sampled after its rows' token bitmask
        self._before_min_tokens = [r for r in reqs if len(r.output_ids) < r.sampling_params.min_tokens]

    def matches(self, reqs: list[Req]) -> bool:
        return reqs == self.reqs and all(r.pages is p for r, p in zip(reqs, self._pages))

    def device_sampling_only(self) -> bool:
        """No request needs host-side sampling state at this step (penalties, a seed, logprobs, pending min_tokens):
        `sampling` alone samples the batch (after the token bitmask where it is `constrained`), so its tokens can
        stay on the device."""
        if self._before_min_tokens:
            self._before_min_tokens = [r for r in self._before_min_tokens
                                       if len(r.output_ids) < r.sampling_params.min_tokens]
        return not (self._host_sampling or self._before_min_tokens)

    def forward_batch(self, input_ids: list[int], positions: list[int]) -> ForwardBatch:
        """The decode ForwardBatch where row i feeds input_ids[i] at positions[i] (its KV slot follows from the
        row's pages). The pages appended since the last step travel in the same upload and are written into the
        page table."""
        ps = self.page_size
        slots = [row[p // ps] * ps + p % ps for row, p in zip(self._pages, positions)]
        rows, cols, pages = self._new_pages()
        n, k = len(positions), len(rows)
        seq_lens = [p + 1 for p in positions]
        ids, positions_dev, locs, patch = packed_to_device([input_ids, positions, slots, [*rows, *cols, *pages]],
                                                           torch.int64, self.device)
        lens, prefixes = packed_to_device([seq_lens, positions], torch.int32, self.device)
        if k:
            patch = patch.view(3, k)
            self.page_table[patch[0], patch[1]] = patch[2].int()
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=ids, positions=positions_dev,
            out_cache_loc=locs, seq_lens=lens, prefix_lens=prefixes, extend_lens=self.extend_lens,
            extend_start_loc=self.extend_start_loc, page_table=self.page_table, logits_indices=self.logits_indices,
            seq_lens_cpu=seq_lens, prefix_lens_cpu=positions, extend_lens_cpu=[1] * n, page_size=self.page_size,
        )

    def _new_pages(self) -> tuple[list[int], list[int], list[int]]:
        """(row, column, page) of each page appended to the requests since the last step; widens the table to fit."""
        num_pages = list(map(len, self._pages))
        if num_pages == self._num_pages:
            return [], [], []
        rows, cols, pages = [], [], []
        for i, (row, known, now) in enumerate(zip(self._pages, self._num_pages, num_pages)):
            if now > known:
                rows += [i] * (now - known)
                cols += range(known, now)
                pages += row[known:]
        self._num_pages = num_pages
        if cols and max(cols) >= self.page_table.shape[1]:
            self._widen(max(cols) + 1)
        return rows, cols, pages

    def _widen(self, need: int) -> None:
        """Doubling (up to the context length's pages), so a long decode widens the table only a few times."""
        width = min(max(need, 2 * self.page_table.shape[1]), max(self.max_pages, need))
        wider = torch.zeros(self.page_table.shape[0], width, dtype=torch.int32, device=self.device)
        wider[:, : self.page_table.shape[1]] = self.page_table
        self.page_table = wider


def _needs_host_sampling(req: Req) -> bool:
    p = req.sampling_params
    return p.has_penalties or req.return_logprob or (p.seed is not None and not p.is_greedy)
