"""Prefill through FlashAttention-4 (`flash_attn.cute`, CuTe DSL kernels for Hopper and Blackwell); decode through
the Triton backend, so CUDA graphs work as they do there.

An extend batch runs as one varlen call: without any cached prefix on the new tokens' own q, k, v (`cu_seqlens`);
with one, every request reads its whole KV through the page table out of the pool, which FlashAttention-4 takes
as `[num_pages, page_size, kv_heads, head_dim]` (the pool's `[num_slots, kv_heads, head_dim]`, viewed so). Its
causal mask is bottom-right aligned: row i of a request with a prefix of P tokens sees KV positions 0 .. P + i,
pdserve's extend semantics.

Measured on H200 (2026-11-23, bf16, 32 query / 8 KV heads of 128): one 8k prompt 690 TFLOP/s (SDPA/cuDNN 526),
16 prompts of 512 tokens 230 (Triton extend 169), 2048 tokens after a 6144-token prefix at page size 16 458
(Triton 333). Its decode (no split-KV on SM90) is slower than the Triton kernel's (batch 1: 18.4 against 10.6 us,
batch 256: 262 against 163), so decode stays on Triton.

FlashAttention-4 compiles each kernel variant on its first call (~3-5 s, cached in the process); the variants
prefill uses are compiled when the backend is built (`warm_up`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from pdserve.attention.base import AttentionBackend
from pdserve.attention.triton_backend import DecodeMetadata, TritonAttnBackend
from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.mem_cache.kv_pool import KVPool

logger = logging.getLogger(__name__)

# flash_attn_varlen_func's contract (the keywords this backend passes); returns out [T, Hq, D] or (out, lse)
VarlenAttention = Callable[..., torch.Tensor | tuple]
# Query lengths of the warm-up: one that fits a single query tile and one that spans several at any GQA ratio
# (FlashAttention-4 compiles a separate, statically scheduled variant for the single-tile case).
WARMUP_QUERY_LENS = (1, 256)


def load_flash_attn() -> VarlenAttention:
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: request b's new tokens are rows cu_seqlens_q[b] .. [b + 1]
    max_seqlen_q: int
    paged: bool  # some request has a cached prefix: every request reads its KV through the page table
    seq_lens: torch.Tensor  # [B] int32: KV length of each request, new tokens included
    page_table: torch.Tensor  # [B, max_pages] int32


def plan_prefill(batch: ForwardBatch) -> PrefillPlan:
    cu_seqlens = F.pad(torch.cumsum(batch.extend_lens, 0, dtype=torch.int32), (1, 0))
    return PrefillPlan(cu_seqlens, max(batch.extend_lens_cpu), any(batch.prefix_lens_cpu), batch.seq_lens,
                       batch.page_table)


def fresh_attention(attend: VarlenAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PrefillPlan,
                    scaling: float) -> torch.Tensor:
    """Causal attention of each request's new tokens over themselves: q [T, Hq, D], k, v [T, Hkv, D]."""
    cu_seqlens, max_seqlen = plan.cu_seqlens_q, plan.max_seqlen_q
    return output(attend(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                         max_seqlen_k=max_seqlen, softmax_scale=scaling, causal=True))


def paged_attention(attend: VarlenAttention, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    plan: PrefillPlan, page_size: int, scaling: float) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole KV in the pool's layer k_cache, v_cache
    [num_slots, Hkv, D] (the new tokens' K/V already stored)."""
    pages = (-1, page_size, *k_cache.shape[1:])
    return output(attend(q, k_cache.view(pages), v_cache.view(pages), cu_seqlens_q=plan.cu_seqlens_q,
                         max_seqlen_q=plan.max_seqlen_q, seqused_k=plan.seq_lens, page_table=plan.page_table,
                         softmax_scale=scaling, causal=True))


def output(result: torch.Tensor | tuple) -> torch.Tensor:
    """The attention output of a FlashAttention-4 call, which returns it alone or as (out, lse)."""
    return result[0] if isinstance(result, tuple) else result


class FlashAttnBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, device, dtype,
                 max_context_len: int, attention_fn: VarlenAttention | None = None):
        """attention_fn: flash_attn.cute.flash_attn_varlen_func unless given (the CPU tests give a torch
        implementation of its contract)."""
        self.triton = TritonAttnBackend(num_heads, num_kv_heads, head_dim, page_size, device, dtype, max_context_len)
        self.page_size = page_size
        self.attention_fn = attention_fn or load_flash_attn()
        self.plan: PrefillPlan | None = None  # the extend batch's; read only while the Triton metadata is extend's
        if self.triton.device.type == "cuda":
            warm_up(self.attention_fn, num_heads, num_kv_heads, head_dim, page_size, self.triton.device, dtype)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.triton.init_forward_metadata(batch)
        if batch.mode == ForwardMode.EXTEND:
            self.plan = plan_prefill(batch)

    @property
    def out_cache_loc(self) -> torch.Tensor:
        return self.triton.out_cache_loc

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, pool: KVPool,
                scaling: float) -> torch.Tensor:
        if isinstance(self.triton.metadata, DecodeMetadata):  # eager or under a CUDA graph
            return self.triton.forward(q, k, v, layer_id, pool, scaling)
        plan = self.plan
        if plan.paged:
            k_cache, v_cache = pool.k_buffer(layer_id), pool.v_buffer(layer_id)
            return paged_attention(self.attention_fn, q, k_cache, v_cache, plan, self.page_size, scaling)
        return fresh_attention(self.attention_fn, q, k, v, plan, scaling)

    def forward_with_amax(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, pool: KVPool,
                          scaling: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(self.triton.metadata, DecodeMetadata):
            return self.triton.forward_with_amax(q, k, v, layer_id, pool, scaling)
        return self.forward(q, k, v, layer_id, pool, scaling), None

    def init_cuda_graph_state(self, max_bs: int, max_pages_per_req: int) -> None:
        self.triton.init_cuda_graph_state(max_bs, max_pages_per_req)

    def init_forward_metadata_capture_cuda_graph(self, bs: int) -> None:
        self.triton.init_forward_metadata_capture_cuda_graph(bs)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch, bs: int) -> None:
        self.triton.init_forward_metadata_replay_cuda_graph(batch, bs)


def warm_up(attend: VarlenAttention, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
            device: torch.device, dtype: torch.dtype) -> float:
    """Runs the fresh and the paged prefill once for each of WARMUP_QUERY_LENS on zero tensors of the model's
    shapes, so that FlashAttention-4 compiles those variants now rather than in the first requests; returns (and
    logs) the seconds it took."""
    started = time.perf_counter()
    int32 = partial(torch.tensor, dtype=torch.int32, device=device)
    for q_len in WARMUP_QUERY_LENS:
        seq_len = page_size + q_len  # the paged call's: after a one-page prefix
        num_pages = -(-seq_len // page_size)
        q = torch.zeros(q_len, num_heads, head_dim, device=device, dtype=dtype)
        kv = torch.zeros(num_pages * page_size, num_kv_heads, head_dim, device=device, dtype=dtype)
        plan = PrefillPlan(int32([0, q_len]), q_len, True, int32([seq_len]), int32([list(range(num_pages))]))
        fresh_attention(attend, q, kv[:q_len], kv[:q_len], plan, head_dim**-0.5)
        paged_attention(attend, q, kv, kv, plan, page_size, head_dim**-0.5)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    logger.info("FlashAttention-4 prefill kernels (fresh and paged, query lengths %s) ready in %.1f s",
                " and ".join(map(str, WARMUP_QUERY_LENS)), seconds)
    return seconds
