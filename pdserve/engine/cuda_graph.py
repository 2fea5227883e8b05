"""Decode CUDA graphs: one graph per padded batch size, captured once, LM head included."""

from __future__ import annotations

import bisect
import logging

import torch
from tqdm import tqdm

from pdserve.attention.base import AttentionBackend, ForwardContext
from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.mem_cache.kv_pool import KVPool

logger = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, max_bs + 1, 8))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class CudaGraphRunner:
    def __init__(self, model, backend: AttentionBackend, pool: KVPool, max_bs: int, max_context_len: int,
                 device: torch.device):
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
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
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
        for bs in tqdm(list(reversed(self.sizes)), desc="Capturing CUDA graphs", leave=False):
            ctx = self._context(self._static_batch(bs), self.backend, self.pool)
            self.backend.init_forward_metadata_capture_cuda_graph(bs)
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up kernels (Triton autotune/JIT) outside the graph
                    self.model(ctx)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool_handle, stream=stream):
                self.outputs[bs] = self.model(ctx)
            self.pool_handle = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(device)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.mode == ForwardMode.DECODE and batch.batch_size <= self.max_bs

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        n = batch.batch_size
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.positions[n:bs].zero_()
        self.backend.init_forward_metadata_replay_cuda_graph(batch, bs)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
