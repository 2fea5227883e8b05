"""Paged attention through the Triton kernels in pdserve.kernels.attention: decode (split-KV) and extend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.attention.base import AttentionBackend
from pdserve.attention.selection import TRITON_HEAD_DIMS
from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.kernels.attention import (
    DecodeWorkspace,
    decode_attention,
    decode_num_splits,
    decode_workspace,
    extend_attention,
)
from pdserve.mem_cache.kv_pool import KVPool


@dataclass(slots=True)
class DecodeMetadata:
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    max_splits: int
    workspace: DecodeWorkspace | None


@dataclass(slots=True)
class ExtendMetadata:
    page_table: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    max_extend_len: int
    out_cache_loc: torch.Tensor


@dataclass(slots=True)
class CudaGraphBuffers:
    """Static decode inputs of max size; a graph of batch size bs reads rows [:bs]."""

    seq_lens: torch.Tensor  # [max_bs] int32
    page_table: torch.Tensor  # [max_bs, max_pages] int32
    out_cache_loc: torch.Tensor  # [max_bs] int64
    padding_loc: torch.Tensor  # [max_bs] int64: row i writes slot i % page_size of page 0
    partial_o: torch.Tensor  # flat split-KV workspace (DecodeWorkspace), large enough for every bs
    partial_lse: torch.Tensor
    counters: torch.Tensor  # zeroed once; every launch leaves its counters zero


class TritonAttnBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, device, dtype,
                 max_context_len: int):
        assert num_heads % num_kv_heads == 0 and head_dim in TRITON_HEAD_DIMS
        assert page_size >= 1 and page_size & (page_size - 1) == 0
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_context_len = max_context_len
        self.metadata: DecodeMetadata | ExtendMetadata | None = None
        self.graph_buffers: CudaGraphBuffers | None = None
        self.counters: torch.Tensor | None = None  # the eager steps' split counters (see split_counters)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode == ForwardMode.DECODE:
            bs = batch.batch_size
            splits = decode_num_splits(bs, self.num_kv_heads, self.device)
            workspace = decode_workspace(bs, self.num_heads, self.num_kv_heads, self.head_dim, splits, self.device,
                                         self.split_counters(bs * self.num_kv_heads))
            self.metadata = DecodeMetadata(batch.page_table, batch.seq_lens, batch.out_cache_loc, splits, workspace)
        else:
            self.metadata = ExtendMetadata(
                batch.page_table, batch.prefix_lens, batch.extend_lens, batch.extend_start_loc,
                max(batch.extend_lens_cpu, default=0), batch.out_cache_loc,
            )

    def split_counters(self, n: int) -> torch.Tensor:
        """Zeroed split counters for eager decode steps, kept from step to step (every launch leaves them zero, and
        launches on the stream run one after another): no new buffer and no memset a step."""
        if self.counters is None or self.counters.numel() < n:
            self.counters = torch.zeros(n, dtype=torch.int32, device=self.device)
        return self.counters

    @property
    def out_cache_loc(self) -> torch.Tensor:
        return self.metadata.out_cache_loc

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, pool: KVPool,
                scaling: float) -> torch.Tensor:
        meta = self.metadata
        if isinstance(meta, DecodeMetadata):
            return self._decode(q, layer_id, pool, scaling, None)
        k_cache, v_cache = pool.k_buffer(layer_id), pool.v_buffer(layer_id)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return extend_attention(
            q, k_cache, v_cache, meta.page_table, meta.prefix_lens, meta.extend_lens, meta.extend_start_loc,
            meta.max_extend_len, out, scaling, self.page_size, k_scale=pool.k_scale(layer_id),
            v_scale=pool.v_scale(layer_id),
        )

    def forward_with_amax(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, pool: KVPool,
                          scaling: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not isinstance(self.metadata, DecodeMetadata):
            return self.forward(q, k, v, layer_id, pool, scaling), None
        parts = torch.empty((q.shape[0], self.num_kv_heads), dtype=torch.float32, device=q.device)
        return self._decode(q, layer_id, pool, scaling, parts), parts

    def _decode(self, q: torch.Tensor, layer_id: int, pool: KVPool, scaling: float,
                amax_parts: torch.Tensor | None) -> torch.Tensor:
        meta = self.metadata
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return decode_attention(
            q, pool.k_buffer(layer_id), pool.v_buffer(layer_id), meta.page_table, meta.seq_lens, out, scaling,
            self.page_size, meta.max_splits, meta.workspace, k_scale=pool.k_scale(layer_id),
            v_scale=pool.v_scale(layer_id), amax_parts=amax_parts,  # the scales are floats: fixed in graphs
        )

    # ------------------------------------------------------------------------------------ CUDA graphs

    def init_cuda_graph_state(self, max_bs: int, max_pages_per_req: int) -> None:
        dev = self.device
        sizes = [DecodeWorkspace.flat_sizes(bs, self.num_heads, self.num_kv_heads, self.head_dim,
                                            decode_num_splits(bs, self.num_kv_heads, dev))
                 for bs in range(1, max_bs + 1)]
        n_o, n_lse, n_counters = (max(column) for column in zip(*sizes))
        self.graph_buffers = CudaGraphBuffers(
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=dev),
            page_table=torch.zeros(max_bs, max_pages_per_req, dtype=torch.int32, device=dev),
            out_cache_loc=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            padding_loc=torch.arange(max_bs, dtype=torch.int64, device=dev) % self.page_size,
            partial_o=torch.empty(n_o, dtype=torch.float32, device=dev),
            partial_lse=torch.empty(n_lse, dtype=torch.float32, device=dev),
            counters=torch.zeros(n_counters, dtype=torch.int32, device=dev),
        )

    def _graph_metadata(self, bs: int) -> DecodeMetadata:
        g = self.graph_buffers
        splits = decode_num_splits(bs, self.num_kv_heads, self.device)
        workspace = None if splits == 1 else DecodeWorkspace.view(
            g.partial_o, g.partial_lse, g.counters, bs, self.num_heads, self.num_kv_heads, self.head_dim, splits)
        return DecodeMetadata(g.page_table[:bs], g.seq_lens[:bs], g.out_cache_loc[:bs], splits, workspace)

    def init_forward_metadata_capture_cuda_graph(self, bs: int) -> None:
        """Point the metadata at the static buffers' first bs rows, all padding (seq_len 1, page 0)."""
        g = self.graph_buffers
        g.seq_lens[:bs].fill_(1)
        g.page_table[:bs].zero_()
        g.out_cache_loc[:bs].copy_(g.padding_loc[:bs])
        self.metadata = self._graph_metadata(bs)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch, bs: int) -> None:
        """Copy a decode batch of n <= bs requests into the static buffers (device copies only, no host sync);
        rows n..bs-1 become padding: seq_len 1, page 0, KV written to slot (row % page_size) of page 0."""
        assert batch.mode == ForwardMode.DECODE
        g = self.graph_buffers
        n, width = batch.batch_size, batch.page_table.shape[1]
        assert n <= bs <= g.seq_lens.shape[0] and width <= g.page_table.shape[1]
        g.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        g.seq_lens[n:bs].fill_(1)
        g.page_table[:n, :width].copy_(batch.page_table, non_blocking=True)
        g.page_table[n:bs].zero_()
        g.out_cache_loc[:n].copy_(batch.out_cache_loc, non_blocking=True)
        g.out_cache_loc[n:bs].copy_(g.padding_loc[n:bs])
        self.metadata = self._graph_metadata(bs)
