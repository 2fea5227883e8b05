"""Prefill without a cached prefix through torch SDPA (FlashAttention inside PyTorch) on the new q, k, v as the
layer left them in its qkv output. cuDNN's attention is left out: it builds an execution plan for every new sequence
length, tens of milliseconds on the host the first time a prompt length comes (`scripts/sdpa_shape_cost.py`), which
made a fresh server's first requests 4x slower than the same requests again (issue 21's cold start). Measured on
H200 (2026-11-21, cuDNN then included): one 8k-token prompt 2x faster than the Triton extend kernel, but 16 prompts
of 512 tokens 4x slower (one SDPA call per request), so requests shorter than SDPA_MIN_LEN, decode and
prefix-extend batches all go to the Triton backend. With an FP8 KV cache the long prompts attend over their K and V
round-tripped through the cache's quantization, as every path reading the cache does."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pdserve.attention.base import AttentionBackend
from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.attention.triton_backend import TritonAttnBackend
from pdserve.kernels.attention import extend_attention
from pdserve.mem_cache.kv_pool import KVPool
from pdserve.mem_cache.kv_quant import is_fp8, round_trip

SDPA_MIN_LEN = 1024
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # no per-shape plans


@dataclass(slots=True)
class SplitPrefill:
    long_rows: list[tuple[int, int]]  # (first row, length) of each request run through SDPA
    short_extend_lens: torch.Tensor  # [B] int32 device: extend_lens with the SDPA requests zeroed
    max_short_len: int


class SdpaAttnBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, device, dtype,
                 max_context_len: int):
        self.triton = TritonAttnBackend(num_heads, num_kv_heads, head_dim, page_size, device, dtype, max_context_len)
        self.gqa = num_heads != num_kv_heads
        self.split: SplitPrefill | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.triton.init_forward_metadata(batch)
        self.split = None
        lens = batch.extend_lens_cpu
        if batch.mode != ForwardMode.EXTEND or any(batch.prefix_lens_cpu) or max(lens, default=0) < SDPA_MIN_LEN:
            return
        starts = [sum(lens[:i]) for i in range(len(lens))]
        long_rows = [(s, n) for s, n in zip(starts, lens) if n >= SDPA_MIN_LEN]
        short = [n if n < SDPA_MIN_LEN else 0 for n in lens]
        short_lens = torch.tensor(short, dtype=torch.int32).to(batch.extend_lens.device, non_blocking=True)
        self.split = SplitPrefill(long_rows, short_lens, max(short))

    @property
    def out_cache_loc(self) -> torch.Tensor:
        return self.triton.out_cache_loc

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, pool: KVPool,
                scaling: float) -> torch.Tensor:
        if self.split is None:
            return self.triton.forward(q, k, v, layer_id, pool, scaling)
        meta, split = self.triton.metadata, self.split
        k_cache, v_cache = pool.k_buffer(layer_id), pool.v_buffer(layer_id)
        k_scale, v_scale = pool.k_scale(layer_id), pool.v_scale(layer_id)
        out = torch.empty_like(q)
        extend_attention(
            q, k_cache, v_cache, meta.page_table, meta.prefix_lens, split.short_extend_lens, meta.extend_start_loc,
            split.max_short_len, out, scaling, self.triton.page_size, k_scale=k_scale, v_scale=v_scale,
        )
        if is_fp8(k_cache.dtype):  # attend to what the cache holds, as every other path does
            k, v = round_trip(k, k_scale, k_cache.dtype), round_trip(v, v_scale, v_cache.dtype)
        with sdpa_kernel(SDPA_BACKENDS):
            for start, length in split.long_rows:
                rows = slice(start, start + length)
                o = F.scaled_dot_product_attention(
                    q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None],
                    is_causal=True, scale=scaling, enable_gqa=self.gqa,
                )
                out[rows] = o[0].transpose(0, 1)
        return out

    def forward_with_amax(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, pool: KVPool,
                          scaling: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.split is None:
            return self.triton.forward_with_amax(q, k, v, layer_id, pool, scaling)
        return self.forward(q, k, v, layer_id, pool, scaling), None

    def init_cuda_graph_state(self, max_bs: int, max_pages_per_req: int) -> None:
        self.triton.init_cuda_graph_state(max_bs, max_pages_per_req)

    def init_forward_metadata_capture_cuda_graph(self, bs: int) -> None:
        self.split = None
        self.triton.init_forward_metadata_capture_cuda_graph(bs)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch, bs: int) -> None:
        self.split = None
        self.triton.init_forward_metadata_replay_cuda_graph(batch, bs)
