"""Decode CUDA graphs: one graph per padded batch size, captured once, LM head and sampling included.

Each graph runs the model to the logits (in the model's dtype) and then `sample(logits, temperatures)` on a static
temperature buffer, writing the tokens into a static buffer: `tokens` replays it for a batch of greedy or
temperature-only rows (the buffer is refilled by one device copy when the batch's temperatures change), `logits`
for the rest, whose sampling needs the logits on the host side of the step (the in-graph draw is then unused).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch
from tqdm import tqdm

from pdserve.attention.base import AttentionBackend, ForwardContext
from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.kernels.parallel_compile import precompile
from pdserve.mem_cache.kv_pool import KVPool

logger = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, max_bs + 1, 8))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class CudaGraphRunner:
    def __init__(self, model, backend: AttentionBackend, pool: KVPool, max_bs: int, max_context_len: int,
                 device: torch.device, sample: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.model = model
        self.backend = backend
        self.pool = pool
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        page_size = pool.layout.page_size
        max_pages = (max_context_len + page_size - 1) // page_size
        backend.init_cuda_graph_state(self.max_bs, max_pages)
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.logits_rows = torch.arange(self.max_bs, dtype=torch.int64, device=device)
        self.temperatures = torch.zeros(self.max_bs, dtype=torch.float32, device=device)
        self._temperatures_of: torch.Tensor | None = None  # the batch tensor `temperatures` holds a copy of
        self.sample = sample
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # (logits, tokens)
        self.pool_handle = None
        self._context = ForwardContext
        self._capture_all(device)

    def _static_batch(self, bs: int) -> ForwardBatch:
        empty = self.input_ids[:0]
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=empty, seq_lens=empty, prefix_lens=empty, extend_lens=empty, extend_start_loc=empty,
            page_table=empty, logits_indices=self.logits_rows[:bs], seq_lens_cpu=[1] * bs, prefix_lens_cpu=[0] * bs,
            extend_lens_cpu=[1] * bs, page_size=self.pool.layout.page_size,
        )

    @torch.inference_mode()
    def _capture_all(self, device: torch.device) -> None:
        stream = torch.cuda.Stream(device)
        precompile(lambda: self._forward_each_size(stream))  # the Triton kernels of every size, compiled in parallel
        for bs in tqdm(list(reversed(self.sizes)), desc="Capturing CUDA graphs", leave=False):
            ctx = self._capture_context(bs)
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up kernels (Triton autotune/JIT) outside the graph
                    self._logits_and_tokens(ctx, bs)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool_handle, stream=stream):
                self.outputs[bs] = self._logits_and_tokens(ctx, bs)
            self.pool_handle = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(device)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def _forward_each_size(self, stream: torch.cuda.Stream) -> None:
        """One step at each captured size, as the capture runs it (under `precompile` its Triton launches only
        record their compiles: the outputs are garbage, and nothing here reads them)."""
        for bs in self.sizes:
            ctx = self._capture_context(bs)
            with torch.cuda.stream(stream):
                self._logits_and_tokens(ctx, bs)

    def _capture_context(self, bs: int) -> ForwardContext:
        """The static batch of size bs as the graphs run it, the backend's capture metadata set for it."""
        ctx = self._context(self._static_batch(bs), self.backend, self.pool)
        self.backend.init_forward_metadata_capture_cuda_graph(bs)
        return ctx

    def _logits_and_tokens(self, ctx: ForwardContext, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(ctx)
        return logits, self.sample(logits, self.temperatures[:bs])

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.mode == ForwardMode.DECODE and batch.batch_size <= self.max_bs

    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """The batch's logits [B, V] (a static buffer: valid until the next replay)."""
        return self._replay(batch)[0][: batch.batch_size]

    def tokens(self, batch: ForwardBatch, temperatures: torch.Tensor) -> torch.Tensor:
        """The batch's next tokens [B] drawn at `temperatures` [B] (a static buffer: valid until the next replay)."""
        if temperatures is not self._temperatures_of:
            self.temperatures[: batch.batch_size].copy_(temperatures, non_blocking=True)
            self._temperatures_of = temperatures
        return self._replay(batch)[1][: batch.batch_size]

    def _replay(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        n = batch.batch_size
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.positions[n:bs].zero_()
        self.backend.init_forward_metadata_replay_cuda_graph(batch, bs)
        self.graphs[bs].replay()
        return self.outputs[bs]
