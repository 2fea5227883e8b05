"""Triton kernels for paged attention: KV store, decode (split-KV + reduce) and extend (cached prefix + causal).

Paged KV layout (pdserve.mem_cache.kv_pool): one layer's K (or V) is `[num_slots, H_kv, D]`; token position `pos`
of request `b` lives in slot `page_table[b, pos // page_size] * page_size + pos % page_size`.
Every launcher works on any device Triton can run on (CUDA, or CPU tensors under TRITON_INTERPRET=1).

An FP8 cache (`pdserve.mem_cache.kv_quant`) is read in the kernels: K and V tiles load as FP8 and are cast to q's
dtype (exact: every FP8 value is a bf16 and an fp16), the layer's K scale is folded into the softmax scale and its V
scale into the output, so dequantizing costs no extra pass over the cache.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.pdl import launch_next, launch_options, wait_for_previous

LOG2E = 1.4426950408889634
DECODE_MAX_SPLITS = 64


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Block shape of the split-KV decode kernel. A split covers at least `min_split_len` tokens (shorter
    contexts run unsplit)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    min_split_len: int = 256


SMALL_BATCH_DECODE = DecodeConfig(block_n=64, num_warps=4, num_stages=2, min_split_len=128)
LARGE_BATCH_DECODE = DecodeConfig(block_n=128, num_warps=4, num_stages=2, min_split_len=256)
LARGE_BATCH_FP8_DECODE = DecodeConfig(block_n=64, num_warps=2, num_stages=3, min_split_len=256)


def decode_config(batch_size: int, fp8_cache: bool = False) -> DecodeConfig:
    """The decode kernel's block shape for a batch size and cache dtype (fixed per batch size: CUDA graphs keep it).

    From pdserve.bench.decode_sweep: up to batch 8 the step is latency-bound, so shorter splits spread one request
    over more SMs (H200, 2026-11-23, benchmarks/results/2026-11-23/issue15; llama-8b heads, batch 1 x 1k: 10.5 -> 7.8
    us; 1 x 8k: 15.2 -> 12.8 us). From batch 16 up, the block shape closest to each case's best over llama-8b heads at
    batch 64 (1k, 4k) and qwen3-0.6b heads at batch 256 (600, 100-2048), with the K and V copies pipelined (H100,
    2026-11-27, benchmarks/results/2026-11-27e): 16-bit pages 1.0% over the best on average (97-99% of the copy
    ceiling), FP8 pages, where the loop's conversions bound it, one more stage and narrower blocks, 2.9% over
    (70-83%; still the best shape with V loaded as words, 86% at 64 x 4k). With V's words converted by inline PTX,
    2 warps a program (H200, 2026-11-29, benchmarks/results/2026-11-29b/call4_v_ptx: 64 x 4k 192.3 -> 181.3 us,
    64 x 16k 739.0 -> 689.4 us, qwen 256 x 600 123.3 -> 120.2 us against 4 warps; qwen 256 x 100-2048 +0.7%).
    """
    if batch_size <= 8:
        return SMALL_BATCH_DECODE
    return LARGE_BATCH_FP8_DECODE if fp8_cache else LARGE_BATCH_DECODE


@functools.cache
def has_fp8_conversion(device: torch.device) -> bool:
    """A CUDA GPU with PTX's FP8 -> f16x2 conversions (compute capability 8.9 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def decode_num_splits(batch_size: int, num_kv_heads: int, device: torch.device) -> int:
    """Upper bound of KV splits per (request, kv head): enough programs to cover the GPU ~4 times.

    Depends on the batch size only (never on sequence lengths), so a CUDA graph captured for a batch size
    keeps a fixed grid; each request uses min(bound, ceil(seq_len / DecodeConfig.min_split_len)) splits in-kernel.
    """
    want = triton.cdiv(4 * num_sms(device), batch_size * num_kv_heads)
    return max(1, min(DECODE_MAX_SPLITS, triton.next_power_of_2(want)))


# ----------------------------------------------------------------------------------------------- KV store


@triton.jit
def _store_kv_kernel(
    K, V, KCache, VCache, Loc,
    stride_kt, stride_vt, stride_ct,
    ROW: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(Loc + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(K + t * stride_kt + offs, mask=mask)
    v = tl.load(V + t * stride_vt + offs, mask=mask)
    tl.store(KCache + slot * stride_ct + offs, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(VCache + slot * stride_ct + offs, v.to(VCache.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor) -> None:
    """k_cache[loc[t]] = k[t] and v_cache[loc[t]] = v[t] for every new token t, in one launch.

    k, v: [T, H_kv, D] (token stride free, heads and dims contiguous); k_cache, v_cache: [num_slots, H_kv, D]
    contiguous; loc: [T] int64 slots. Casts to the cache dtype. Writes in place, returns nothing.
    """
    num_tokens, heads, dim = k.shape
    assert k.stride(2) == 1 and k.stride(1) == dim and v.stride(2) == 1 and v.stride(1) == dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.stride(0) == heads * dim
    if num_tokens == 0:
        return
    row = heads * dim
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, loc, k.stride(0), v.stride(0), k_cache.stride(0),
        ROW=row, BLOCK=triton.next_power_of_2(row), num_warps=4,
    )


# ----------------------------------------------------------------------------------------------- decode


@triton.jit
def _decode_splits(seq_len, MAX_SPLITS: tl.constexpr, MIN_SPLIT_LEN: tl.constexpr):
    return tl.maximum(tl.minimum(tl.cdiv(seq_len, MIN_SPLIT_LEN), MAX_SPLITS), 1)


@triton.jit
def _fp8_words_to(words, fp8_type: tl.constexpr, dtype: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                  PTX: tl.constexpr):
    """[ROWS, COLS // 4] int32 words, each four FP8 values in memory order, -> [ROWS, COLS] in dtype.
    PTX (CUDA): each half of a word converted to two fp16 by one `cvt.rn.f16x2` (with the bytes cast one by one,
    Triton 3.6 extracts them and pairs them up again for that instruction: the decode loop ran 722 instead of 578
    instructions a warp per 64-token block, compiled for sm_90; H200, 2026-11-29: batch 64 x 4k 194.2 -> 181.3 us,
    66% -> 70% of the copy ceiling at the 2-warp config; sm_89 and newer); else byte by byte (the interpreter, older
    GPUs). Both exact."""
    if PTX:
        cvt: tl.constexpr = "cvt.rn.f16x2.e5m2x2" if fp8_type == tl.float8e5 else "cvt.rn.f16x2.e4m3x2"
        h0, h1, h2, h3 = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; " + cvt + " a, lo; " + cvt + " b, hi; "
            "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
            "=h,=h,=h,=h,r", [words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
        return tl.reshape(tl.join(tl.join(h0, h2), tl.join(h1, h3)), [ROWS, COLS]).to(dtype)
    b0 = (words & 0xFF).to(tl.uint8).to(fp8_type, bitcast=True).to(dtype)
    b1 = ((words >> 8) & 0xFF).to(tl.uint8).to(fp8_type, bitcast=True).to(dtype)
    b2 = ((words >> 16) & 0xFF).to(tl.uint8).to(fp8_type, bitcast=True).to(dtype)
    b3 = ((words >> 24) & 0xFF).to(tl.uint8).to(fp8_type, bitcast=True).to(dtype)
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), [ROWS, COLS])


@triton.jit(do_not_specialize=["stride_pb"])  # the page table's width varies with the batch: one variant for all
def _decode_split_kernel(
    Q, K, V, PageTable, SeqLens, Out, PartialO, PartialLse, Counters, AmaxOut,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pb, stride_ob, stride_oh, stride_ab,
    sm_scale_log2, v_scale,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr, MIN_SPLIT_LEN: tl.constexpr, FP16_DOTS: tl.constexpr,
    V_WORDS: tl.constexpr, PTX: tl.constexpr, AMAX: tl.constexpr, PDL: tl.constexpr,
):
    """One program: all GROUP query heads of kv head `kvh` of request `b`, over one split of the context.
    FP16_DOTS (an FP8 cache read by bf16 queries): the dots run in fp16, since every FP8 value is an fp16 (E4M3 to
    fp16 is one instruction for two values, to bf16 four) and with half the bytes per token the bf16 conversion
    was the bound (H200, 2026-11-27: batch 64 x 4k at 54% of the copy ceiling). q is rounded to fp16 once (exact
    in fp16's normal range; a query beyond 65504 would overflow) and the probabilities get 10 mantissa bits.
    V_WORDS (an FP8 cache; V and its strides in int32 words): V tiles come as words, unpacked to the dot's dtype in
    registers before shared memory. The PV product takes V transposed, which 16-bit values get from transposing
    ldmatrix loads and 8-bit ones, for Triton 3.6 on sm_90, from byte-by-byte shared-memory loads (H100, 2026-11-27,
    batch 64 x 4k, llama-8b heads: 219.5 -> 208.8 us, 81% -> 86% of the copy ceiling); PTX: converted by inline PTX
    (`_fp8_words_to`; CUDA only).
    AMAX: the program writing the output of (b, kvh) also writes the amax of its rounded values to
    AmaxOut[b, kvh] (stride_ab): the parts of each row's amax an FP8 o projection reads
    (`pdserve.kernels.pending_rows.RowsWithAmax`)."""
    wait_for_previous(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    splits = _decode_splits(seq_len, MAX_SPLITS, MIN_SPLIT_LEN)
    if split >= splits:
        return
    split_len = tl.cdiv(tl.cdiv(seq_len, splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_H)
    mask_g = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_g[:, None], other=0.0)
    if FP16_DOTS:
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    page_row = PageTable + b.to(tl.int64) * stride_pb
    # The pages of block n0 are loaded an iteration ahead: with K and V addresses made from a load of the same
    # iteration Triton 3.6 does not pipeline the K and V copies at all (one buffer, `cp.async.wait_group 0` each
    # iteration, whatever num_stages); from a loop-carried value it keeps num_stages - 1 blocks in flight.
    first = start + tl.arange(0, BLOCK_N)
    pages = tl.load(page_row + first // PAGE_SIZE, mask=first < end, other=0)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        mask_n = pos < end
        slot = pages.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        ahead = pos + BLOCK_N
        pages = tl.load(page_row + ahead // PAGE_SIZE, mask=ahead < end, other=0)
        k = tl.load(K + slot[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None], mask=mask_n[None, :], other=0.0)
        qk = tl.dot(q, k.to(q.dtype)) * sm_scale_log2
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_WORDS:
            words = tl.load(V + slot[:, None] * stride_vt + kvh * stride_vh + tl.arange(0, HEAD_DIM // 4)[None, :],
                            mask=mask_n[:, None], other=0)
            v = _fp8_words_to(words, K.dtype.element_ty, q.dtype, BLOCK_N, HEAD_DIM, PTX)
        else:
            v = tl.load(V + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=mask_n[:, None],
                        other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    launch_next(PDL)
    out = acc / l_safe[:, None] * v_scale
    if MAX_SPLITS == 1:
        o_ptrs = Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        _store_output(o_ptrs, out, mask_g, AmaxOut + b * stride_ab + kvh, AMAX)
    else:
        # PartialO: [B, H_q, MAX_SPLITS, HEAD_DIM] fp32, PartialLse: [B, H_q, MAX_SPLITS] fp32 (log2 domain)
        row = (b * tl.num_programs(1) * GROUP + heads) * MAX_SPLITS + split
        tl.store(PartialO + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=mask_g[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(PartialLse + row, lse, mask=mask_g)
        tl.debug_barrier()  # every thread's partials stored before the counter's release
        counter = Counters + b * tl.num_programs(1) + kvh
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == splits - 1:
            o_ptrs = Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            out = _merge_splits(PartialO, PartialLse, row - split, splits, mask_g, BLOCK_H, HEAD_DIM, MAX_SPLITS)
            _store_output(o_ptrs, out, mask_g, AmaxOut + b * stride_ab + kvh, AMAX)
            tl.store(counter, 0)


@triton.jit
def _store_output(o_ptrs, out, mask_g, amax_ptr, AMAX: tl.constexpr):
    """A (request, kv head)'s output rounded to Out's dtype, and with AMAX the amax of its rounded values."""
    rounded = out.to(o_ptrs.dtype.element_ty)
    tl.store(o_ptrs, rounded, mask=mask_g[:, None])
    if AMAX:
        tl.store(amax_ptr, tl.max(tl.max(tl.where(mask_g[:, None], tl.abs(rounded.to(tl.float32)), 0.0), 1), 0))


@triton.jit
def _merge_splits(PartialO, PartialLse, first_row, splits, mask_g,
                  BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """Run by the last split program of a (request, kv head) to finish (Counters says which): its query heads'
    partial outputs weighted by their softmax sums, added in split order (the same sums whichever program is last);
    returns the output in float32.
    .cg loads: the other programs' partials, read past this SM's L1."""
    offs_s = tl.arange(0, MAX_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(PartialLse + first_row[:, None] + offs_s[None, :], mask=mask_g[:, None] & (offs_s < splits)[None, :],
                  other=float("-inf"), cache_modifier=".cg")
    m = tl.where(mask_g, tl.max(lse, 1), 0.0)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    for s in range(0, splits):
        w = tl.exp2(tl.load(PartialLse + first_row + s, mask=mask_g, other=float("-inf"), cache_modifier=".cg") - m)
        o = tl.load(PartialO + (first_row + s)[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_g[:, None], other=0.0,
                    cache_modifier=".cg")
        acc += o * w[:, None]
        total += w
    return acc / tl.where(total > 0, total, 1.0)[:, None]


@dataclass(frozen=True, slots=True)
class DecodeWorkspace:
    """Split-KV decode scratch: partial_o [B, H_q, S, D] fp32, partial_lse [B, H_q, S] fp32, and counters
    [B * H_kv] int32, zero between launches (the last split program of each (request, kv head) puts its back)."""

    partial_o: torch.Tensor
    partial_lse: torch.Tensor
    counters: torch.Tensor

    @staticmethod
    def flat_sizes(batch_size: int, num_heads: int, num_kv_heads: int, head_dim: int, max_splits: int
                   ) -> tuple[int, int, int]:
        rows = batch_size * num_heads * max_splits
        return rows * head_dim, rows, batch_size * num_kv_heads

    @classmethod
    def view(cls, partial_o: torch.Tensor, partial_lse: torch.Tensor, counters: torch.Tensor, batch_size: int,
             num_heads: int, num_kv_heads: int, head_dim: int, max_splits: int) -> DecodeWorkspace:
        """The first rows of flat buffers (of at least `flat_sizes`) as one batch's workspace."""
        n_o, n_lse, n_counters = cls.flat_sizes(batch_size, num_heads, num_kv_heads, head_dim, max_splits)
        return cls(partial_o[:n_o].view(batch_size, num_heads, max_splits, head_dim),
                   partial_lse[:n_lse].view(batch_size, num_heads, max_splits), counters[:n_counters])


def decode_workspace(batch_size: int, num_heads: int, num_kv_heads: int, head_dim: int, max_splits: int,
                     device, counters: torch.Tensor | None = None) -> DecodeWorkspace | None:
    """Fresh split-KV decode scratch; None when max_splits == 1. counters: zeroed int32 counters of at least
    batch_size * num_kv_heads to reuse (launches leave them zero), else new ones."""
    if max_splits == 1:
        return None
    n_o, n_lse, n_counters = DecodeWorkspace.flat_sizes(batch_size, num_heads, num_kv_heads, head_dim, max_splits)
    if counters is None:
        counters = torch.zeros(n_counters, dtype=torch.int32, device=device)
    return DecodeWorkspace.view(torch.empty(n_o, dtype=torch.float32, device=device),
                                torch.empty(n_lse, dtype=torch.float32, device=device), counters,
                                batch_size, num_heads, num_kv_heads, head_dim, max_splits)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
    out: torch.Tensor, scaling: float, page_size: int, max_splits: int, workspace: DecodeWorkspace | None = None,
    config: DecodeConfig | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
    amax_parts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged decode attention: request b's single query attends to KV positions 0..seq_lens[b]-1.

    q: [B, H_q, D] (head_dim contiguous), k_cache/v_cache: [num_slots, H_kv, D], page_table: [B, >=pages] int32,
    seq_lens: [B] int32 (>= 1), out: [B, H_q, D] written in place (any float dtype) and returned.
    max_splits: power of 2 (see decode_num_splits); workspace (decode_workspace) when it is > 1: one launch, the last
    split program of each (request, kv head) merging the splits.
    config: block shape (default decode_config(B, FP8 cache)). k_scale, v_scale: the layer's scales of an FP8 cache
    (1 else). amax_parts: [B, H_kv] float32 (row stride free) to take the amax of each (request, kv head)'s
    rounded output: the parts of each output row's amax.
    Launches only fixed-shape kernels and never syncs with the host (CUDA-graph safe).
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    assert max_splits & (max_splits - 1) == 0
    if max_splits > 1 and workspace is None:
        workspace = decode_workspace(batch, num_heads, num_kv_heads, head_dim, max_splits, q.device)
    scratch = (workspace.partial_o, workspace.partial_lse, workspace.counters) if workspace else (out, out, out)
    fp8 = k_cache.dtype.itemsize == 1
    cfg = config or decode_config(batch, fp8)
    v_words = v_cache.view(torch.int32) if fp8 else v_cache  # V_WORDS: head_dim is a multiple of 4 (16 or more)
    assert amax_parts is None or (amax_parts.shape == (batch, num_kv_heads) and amax_parts.stride(1) == 1)
    amax_out = out if amax_parts is None else amax_parts
    _decode_split_kernel[(batch, num_kv_heads, max_splits)](
        q, k_cache, v_words, page_table, seq_lens, out, *scratch, amax_out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_words.stride(0), v_words.stride(1),
        page_table.stride(0), out.stride(0), out.stride(1), amax_out.stride(0),
        scaling * LOG2E * k_scale, v_scale,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_N=cfg.block_n, MAX_SPLITS=max_splits, MIN_SPLIT_LEN=cfg.min_split_len,
        FP16_DOTS=fp8 and q.dtype == torch.bfloat16, V_WORDS=fp8, PTX=fp8 and has_fp8_conversion(q.device),
        AMAX=amax_parts is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_options(q.device),
    )
    return out


# ----------------------------------------------------------------------------------------------- extend


@triton.jit
def _extend_block(
    acc, m_i, l_i, pages, q, K, V, page_row, kvh, n0, q_pos, kv_end,
    stride_kt, stride_kh, stride_vt, stride_vh, sm_scale_log2,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
):
    """One KV block of the online softmax; K and V tiles are cast to q's dtype (FP8 caches: scales applied by the
    caller). pages: the block's page of each position, loaded a block ahead (see _decode_split_kernel); returns the
    next block's with the running state."""
    offs_d = tl.arange(0, HEAD_DIM)
    pos = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        mask_n = pos < kv_end
    slot = pages.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
    ahead = pos + BLOCK_N
    pages = tl.load(page_row + ahead // PAGE_SIZE, mask=ahead < kv_end, other=0)
    if MASKED:
        k = tl.load(K + slot[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None], mask=mask_n[None, :], other=0.0)
        qk = tl.dot(q, k.to(q.dtype)) * sm_scale_log2
        qk = tl.where((pos[None, :] <= q_pos[:, None]) & mask_n[None, :], qk, float("-inf"))
    else:
        k = tl.load(K + slot[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None])
        qk = tl.dot(q, k.to(q.dtype)) * sm_scale_log2
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(V + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    else:
        v = tl.load(V + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :])
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return acc, m_new, l_i, pages


@triton.jit(do_not_specialize=["stride_pb"])  # the page table's width varies with the batch: one variant for all
def _extend_kernel(
    Q, K, V, Out, PageTable, PrefixLens, ExtendLens, ExtendStart,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pb, stride_ot, stride_oh,
    sm_scale_log2, v_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_M new tokens of request b, query head h. KV (prefix and new) is read from the pool."""
    h = tl.program_id(0)
    b = tl.program_id(2)
    extend_len = tl.load(ExtendLens + b)
    mblk = tl.cdiv(extend_len, BLOCK_M) - 1 - tl.program_id(1)  # longest rows of the causal triangle first
    if mblk < 0:
        return
    prefix_len = tl.load(PrefixLens + b)
    q_start = tl.load(ExtendStart + b)
    kvh = h // GROUP
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < extend_len
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=mask_m[:, None], other=0.0)
    q_pos = prefix_len + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    page_row = PageTable + b.to(tl.int64) * stride_pb
    # KV positions below the block's first query position are visible to every row: no mask needed.
    full_end = (prefix_len + mblk * BLOCK_M) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(prefix_len + (mblk + 1) * BLOCK_M, prefix_len + extend_len)
    first = tl.arange(0, BLOCK_N)
    pages = tl.load(page_row + first // PAGE_SIZE, mask=first < kv_end, other=0)  # carried through both loops
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i, pages = _extend_block(
            acc, m_i, l_i, pages, q, K, V, page_row, kvh, n0, q_pos, kv_end,
            stride_kt, stride_kh, stride_vt, stride_vh, sm_scale_log2, HEAD_DIM, PAGE_SIZE, BLOCK_N, False,
        )
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i, pages = _extend_block(
            acc, m_i, l_i, pages, q, K, V, page_row, kvh, n0, q_pos, kv_end,
            stride_kt, stride_kh, stride_vt, stride_vh, sm_scale_log2, HEAD_DIM, PAGE_SIZE, BLOCK_N, True,
        )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
    tl.store(Out + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=mask_m[:, None])


def extend_config(head_dim: int, device: torch.device) -> dict:
    if device.type != "cuda":
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
    # best of pdserve.bench.kernels' sweep for head_dim 128 on H200 (2026-11-21): 370-400 TFLOP/s at 8k tokens
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)


def extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    prefix_lens: torch.Tensor, extend_lens: torch.Tensor, extend_start_loc: torch.Tensor, max_extend_len: int,
    out: torch.Tensor, scaling: float, page_size: int, config: dict | None = None, k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Paged extend (prefill on top of a cached prefix) attention; the new tokens' K/V must already be stored.

    q: [T, H_q, D] (head_dim contiguous); request b's rows extend_start_loc[b] .. + extend_lens[b]; its row i
    sits at position prefix_lens[b] + i and attends to KV positions 0 .. prefix_lens[b] + i, read from
    k_cache/v_cache [num_slots, H_kv, D] through page_table [B, >=pages] int32. prefix_lens, extend_lens,
    extend_start_loc: [B] int32; max_extend_len: host int >= max(extend_lens). out: [T, H_q, D] written in
    place and returned. Rows of q outside every request are left unwritten. k_scale, v_scale: the layer's scales
    of an FP8 cache (1 else).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[1]
    cfg = config or extend_config(head_dim, q.device)
    batch = prefix_lens.shape[0]
    if batch == 0 or max_extend_len == 0:
        return out
    grid = (num_heads, triton.cdiv(max_extend_len, cfg["BLOCK_M"]), batch)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, page_table, prefix_lens, extend_lens, extend_start_loc,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        page_table.stride(0), out.stride(0), out.stride(1),
        scaling * LOG2E * k_scale, v_scale,
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, **cfg,
    )
    return out


def attention_flops(q_lens: list[int], kv_lens: list[int], num_heads: int, head_dim: int) -> int:
    """Matmul FLOPs of causal attention (QK^T and PV), counting only the visible (unmasked) pairs."""
    pairs = sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in zip(q_lens, kv_lens))
    return 4 * pairs * num_heads * head_dim
