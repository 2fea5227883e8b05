"""Prefill without a cached prefix through torch attention (FlashAttention / cuDNN inside PyTorch) on the
contiguous new q, k, v; decode and prefix-extend batches go to the Triton backend."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from pdserve.attention.base import AttentionBackend, ForwardBatch, ForwardMode
from pdserve.attention.triton_backend import TritonAttnBackend
from pdserve.kernels.attention import store_kv
from pdserve.mem_cache.kv_pool import KVPool


def _varlen_attn_fn():
    """torch.nn.attention.varlen.varlen_attn when this PyTorch has the causal + GQA form, else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn if "window_size" in params and "enable_gqa" in params else None


VARLEN_ATTN = _varlen_attn_fn()


class SdpaAttnBackend(AttentionBackend):
    """ragged_impl: "varlen" (one varlen_attn call per layer) or "loop" (one SDPA call per request);
    None picks varlen when available."""

    supports_cuda_graph = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, device, dtype,
                 max_context_len: int, *, ragged_impl: str | None = None):
        self.triton = TritonAttnBackend(num_heads, num_kv_heads, head_dim, page_size, device, dtype, max_context_len)
        self.ragged_impl = ragged_impl or ("varlen" if VARLEN_ATTN is not None else "loop")
        assert self.ragged_impl in ("varlen", "loop")
        assert self.ragged_impl == "loop" or VARLEN_ATTN is not None
        self.gqa = num_heads != num_kv_heads
        self.ragged: tuple | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.triton.init_forward_metadata(batch)
        self.ragged = None
        if batch.mode == ForwardMode.EXTEND and not any(batch.prefix_lens_cpu):
            lens = batch.extend_lens_cpu
            starts = [sum(lens[:i]) for i in range(len(lens))] if self.ragged_impl == "loop" else None
            cu_seqlens = None
            if self.ragged_impl == "varlen":
                total = torch.tensor([batch.num_tokens], dtype=torch.int32).to(batch.extend_start_loc.device)
                cu_seqlens = torch.cat([batch.extend_start_loc.to(torch.int32), total])
            self.ragged = (lens, starts, cu_seqlens, batch.out_cache_loc)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, pool: KVPool,
                scaling: float) -> torch.Tensor:
        if self.ragged is None:
            return self.triton.forward(q, k, v, layer_id, pool, scaling)
        lens, starts, cu_seqlens, out_cache_loc = self.ragged
        store_kv(k, v, pool.k_buffer(layer_id), pool.v_buffer(layer_id), out_cache_loc)
        if cu_seqlens is not None:
            max_len = max(lens)
            return VARLEN_ATTN(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scaling,
                               window_size=(-1, 0), enable_gqa=self.gqa)
        out = torch.empty_like(q)
        for start, length in zip(starts, lens):
            rows = slice(start, start + length)
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None],
                is_causal=True, scale=scaling, enable_gqa=self.gqa,
            )
            out[rows] = o[0].transpose(0, 1)
        return out

    def init_cuda_graph_state(self, max_bs: int, max_pages_per_req: int) -> None:
        self.triton.init_cuda_graph_state(max_bs, max_pages_per_req)

    def init_forward_metadata_capture_cuda_graph(self, bs: int) -> None:
        self.ragged = None
        self.triton.init_forward_metadata_capture_cuda_graph(bs)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch, bs: int) -> None:
        self.ragged = None
        self.triton.init_forward_metadata_replay_cuda_graph(batch, bs)
