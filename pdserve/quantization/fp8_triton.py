"""The Triton kernel of FP8 linear layers (imports Triton), launched by `pdserve.quantization.fp8`:
`fp8_rows_kernel`, the product of a decode batch's few rows with an FP8 weight. The kernels that quantize rows
for it (per token, the same bytes and scales) are in `pdserve.kernels.fused`; it may also compute its rows itself
from the RMSNorm before it (`pdserve.kernels.pending_rows`), with that kernel's arithmetic (`normed`)."""

from __future__ import annotations

import triton
import triton.language as tl

from pdserve.kernels.fused import to_cache, to_e4m3
from pdserve.kernels.pdl import launch_next, wait_for_previous
from pdserve.kernels.skinny_triton import load_blocks


@triton.jit
def residual_sum(x, Residual, mask, stride_rm, offs_m, cols):
    """x + residual, rounded to x's dtype (the RMSNorm kernel's h)."""
    r = tl.load(Residual + offs_m[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
    return (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)


@triton.jit
def normed(h, rstd, NormWeight, cols, K):
    """The RMSNorm kernel's output from h = x + residual and each row's rstd, in h's dtype."""
    w = tl.load(NormWeight + cols, mask=cols < K, other=0.0).to(tl.float32)
    return ((h.to(tl.float32) * rstd[:, None]).to(h.dtype).to(tl.float32) * w[None, :]).to(h.dtype)


@triton.jit(do_not_specialize=["M", "eps"])  # the batch's rows, a mask bound: one variant for every batch size
def fp8_rows_kernel(
    X, XScale, W, WScale, StaticScale, B, Out, Partial, Counters, Residual, NormWeight, ResidualOut, M, N, K,
    K_SPLIT, stride_xm, stride_wn, stride_om, stride_res, stride_rm, eps, Pos, Loc, CosSin, KCache, VCache, stride_c,
    stride_ct, k_inv_scale, v_inv_scale, AmaxParts, stride_ap, num_parts, AmaxOut, stride_ao,
    FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, QUANTIZE: tl.constexpr,
    STATIC: tl.constexpr, HW_CAST: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PROMOTE_K: tl.constexpr, SPLIT_K: tl.constexpr,
    AMAX_BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, ROPE: tl.constexpr,
    HEADS_Q: tl.constexpr, HEADS_KV: tl.constexpr, HALF: tl.constexpr, KV_QUANT: tl.constexpr,
    KV_FP8_MAX: tl.constexpr, PARTS: tl.constexpr, PRELOAD: tl.constexpr, PDL: tl.constexpr,
):
    """Output columns [pid0 * BLOCK_N, +BLOCK_N) of the M <= ROWS rows, the weight block as the MMA's wide side and
    the rows as its narrow side (the compiler pads it to the MMA's width), so the FP8 weight is streamed once. How
    the FP8 dot runs is the compiler's: at 1 row Triton 3.6 converts the E4M3 blocks to fp16 in registers for fp16
    MMAs on Hopper (ncu, H100, 2026-11-27), on issue slots that are mostly idle there; at 64 rows it issues FP8
    wgmma (QGMMA; both from the compiled SASS). QUANTIZE: X holds the rows in the model dtype and each program
    quantizes them itself (a pass for their amax in AMAX_BLOCK columns at a time, a whole row of a few rows in one
    load: that pass is a chain of L2 round trips before the first weight block; then each block as it streams: the
    same bytes and scales as `quantize_tokens`); else X is already FP8 with its row scales in XScale.
    PARTS > 0 (QUANTIZE, no NORM): the kernel that made the rows left each row's amax in num_parts parts (AmaxParts,
    stride_ap; `pdserve.kernels.pending_rows.RowsWithAmax`), PARTS of them loaded at once: their max is the amax
    the pass would find (a max is exact in any order), so the pass is one small load.
    Hopper's FP8 MMA sums with fewer bits than float32: the partial sums are added in float32 every PROMOTE_K
    products. SPLIT_K > 1 (a weight with few output blocks and a long K, e.g. the MLP's down projection: more
    programs streaming at once): program pid1 sums K range [pid1 * K_SPLIT, +K_SPLIT) into Partial and counts
    itself done in Counters[pid0]; the last of the column block's SPLIT_K programs adds the partials in split order
    (the same sums whichever program comes last), writes the output and puts the counter back to 0.
    NORM (QUANTIZE only): the rows are RMSNorm(X + Residual) * NormWeight (`pdserve.kernels.pending_rows`),
    computed block by block as they are quantized: a first pass sums the squares of X + Residual for each row's rstd
    (in another order than the RMSNorm kernel: the same up to float32 rounding) and program (0, 0) writes X +
    Residual to ResidualOut (stride_rm), the residual stream the next layer reads. ONE_BLOCK (K <= AMAX_BLOCK): that
    pass is one load, whose rows give the amax too, so the rows are read once before the weight blocks stream.
    GATED (no bias): W is a gate_up projection's [gate; up] (N rows, N // 2 each) and Out takes SiLU(gate) * up
    (N // 2 columns), with the SiLU-and-mul kernel's arithmetic on the rounded gate and up: the program's block
    interleaves gate rows [pid0 * BLOCK_N / 2, +BLOCK_N / 2) with the same up rows, so each output column has both
    of its sums (`paired_rows`); and the amax of each row's rounded block in AmaxOut[row, pid0] (stride_ao), the
    parts a down projection's kernel reads (PARTS).
    ROPE: W is a qkv projection's (HEADS_Q q heads, HEADS_KV k heads, HEADS_KV v heads, 2 * HALF rows each) and the
    kernel does what `qk_norm_rope_store_kv` does after it without a norm (`rope_store`): the block pairs rows i
    and i + HALF of one head, as neox rotary does, so each program rotates its q or k pairs at the rows' positions
    (Pos, CosSin) and writes them into Out, and a k or v program also into KCache / VCache at slots Loc (an FP8
    cache: KV_QUANT, at the layer's inverse scales).
    PDL: launched while the kernel before runs, it waits for that kernel before any load but PRELOAD's and lets the
    next kernel launch when its weight blocks are streamed (`pdserve.kernels.pdl`). PRELOAD (few rows): the first
    weight block is read before the wait (weights are written at load only, never by the kernel just before), so
    its bytes come while the kernel before finishes (H100, 2026-11-27, llama-3.1-8b batch 1: 3.600 -> 3.539 ms a step); its product outside the
    loop takes another pipeline stage of shared memory, which many rows' blocks have no room for."""
    pid_n = tl.program_id(0)
    if GATED:
        offs_n, mask_n = paired_rows(pid_n, N, N // 2, BLOCK_N)
    elif ROPE:
        offs_n, mask_n = paired_rows(pid_n, N, HALF, BLOCK_N)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    k_start = tl.program_id(1) * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + k_start + offs_k[None, :]
    if PRELOAD:
        if EVEN_K:  # whole blocks (or none: an empty split)
            w_first = tl.load(w_ptrs, mask=mask_n[:, None] & (k_start < k_end), other=0.0)
        else:
            w_first = tl.load(w_ptrs, mask=mask_n[:, None] & (k_start + offs_k < k_end)[None, :], other=0.0)
    wait_for_previous(PDL)
    offs_m = tl.arange(0, ROWS)
    mask_m = offs_m < M
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    offs_a = tl.arange(0, AMAX_BLOCK)
    rstd = tl.zeros([ROWS], dtype=tl.float32)
    amax = tl.zeros([ROWS], dtype=tl.float32)
    if NORM:
        first_program = (pid_n == 0) & (tl.program_id(1) == 0)
        if ONE_BLOCK:
            row_mask = mask_m[:, None] & (offs_a < K)[None, :]
            row = tl.load(X + offs_m[:, None] * stride_xm + offs_a[None, :], mask=row_mask, other=0.0)
            h_row = residual_sum(row, Residual, row_mask, stride_res, offs_m, offs_a)
            tl.store(ResidualOut + offs_m[:, None] * stride_rm + offs_a[None, :], h_row, mask=row_mask & first_program)
            rstd = tl.rsqrt(tl.sum(h_row.to(tl.float32) * h_row.to(tl.float32), 1) / K + eps)
            amax = tl.max(tl.abs(normed(h_row, rstd, NormWeight, offs_a, K).to(tl.float32)), 1)
        else:
            squares = tl.zeros([ROWS], dtype=tl.float32)
            for k0 in range(0, K, AMAX_BLOCK):
                row_mask = mask_m[:, None] & ((k0 + offs_a) < K)[None, :]
                row = tl.load(X + offs_m[:, None] * stride_xm + k0 + offs_a[None, :], mask=row_mask, other=0.0)
                h_row = residual_sum(row, Residual, row_mask, stride_res, offs_m, k0 + offs_a)
                tl.store(ResidualOut + offs_m[:, None] * stride_rm + k0 + offs_a[None, :], h_row,
                         mask=row_mask & first_program)
                squares += tl.sum(h_row.to(tl.float32) * h_row.to(tl.float32), 1)
            rstd = tl.rsqrt(squares / K + eps)
    if not QUANTIZE:
        x_scale = tl.load(XScale + offs_m, mask=mask_m, other=0.0)
    elif STATIC:
        x_scale = tl.zeros([ROWS], dtype=tl.float32) + tl.load(StaticScale)
    else:
        if PARTS > 0:
            offs_p = tl.arange(0, PARTS)
            parts = tl.load(AmaxParts + offs_m[:, None] * stride_ap + offs_p[None, :],
                            mask=mask_m[:, None] & (offs_p < num_parts)[None, :], other=0.0)
            amax = tl.max(parts, 1)
        elif not NORM or not ONE_BLOCK:  # else the amax came with the rstd
            for k0 in range(0, K, AMAX_BLOCK):
                row_mask = mask_m[:, None] & ((k0 + offs_a) < K)[None, :]
                row = tl.load(X + offs_m[:, None] * stride_xm + k0 + offs_a[None, :], mask=row_mask, other=0.0)
                if NORM:
                    row = normed(residual_sum(row, Residual, row_mask, stride_res, offs_m, k0 + offs_a), rstd,
                                 NormWeight, k0 + offs_a, K)
                amax = tl.maximum(amax, tl.max(tl.abs(row.to(tl.float32)), axis=1))
        x_scale = tl.maximum(amax * INV_FP8_MAX, MIN_SCALE)
    if QUANTIZE:
        x_inv_scale = tl.div_rn(tl.full([ROWS], 1.0, tl.float32), x_scale)
    else:  # unread: the rows come quantized
        x_inv_scale = x_scale
    x_ptrs += k_start
    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    loop_start = k_start
    if PRELOAD:  # the first block's product, from the block read before the wait
        x = tl.load(x_ptrs, mask=mask_m[:, None] & (k_start + offs_k < k_end)[None, :], other=0.0)
        x = rows_block(x, k_start, k_end, offs_k, offs_m, mask_m, x_inv_scale, Residual, stride_res, rstd,
                       NormWeight, K, QUANTIZE, NORM, FP8_MAX, HW_CAST)
        acc = tl.dot(w_first, tl.trans(x), acc, max_num_imprecise_acc=PROMOTE_K)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        loop_start += BLOCK_K
    for k0 in range(loop_start, k_end, BLOCK_K):
        w, x = load_blocks(w_ptrs, x_ptrs, mask_n, mask_m, k0 + offs_k < k_end, EVEN_K)
        x = rows_block(x, k0, k_end, offs_k, offs_m, mask_m, x_inv_scale, Residual, stride_res, rstd, NormWeight, K,
                       QUANTIZE, NORM, FP8_MAX, HW_CAST)
        acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=PROMOTE_K)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    launch_next(PDL)
    if SPLIT_K > 1:
        tile = tl.arange(0, BLOCK_N)[:, None] * ROWS + offs_m[None, :]
        tl.store(Partial + (tl.program_id(1) * tl.num_programs(0) + pid_n) * (BLOCK_N * ROWS) + tile, acc)
        tl.debug_barrier()  # every thread's partial stored before the counter's release
        if tl.atomic_add(Counters + pid_n, 1, sem="acq_rel", scope="gpu") != SPLIT_K - 1:
            return
        acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
        for split in range(SPLIT_K):
            acc += tl.load(Partial + (split * tl.num_programs(0) + pid_n) * (BLOCK_N * ROWS) + tile,
                           cache_modifier=".cg")
        tl.store(Counters + pid_n, 0)
    acc = acc * tl.load(WScale + offs_n, mask=mask_n, other=0.0)[:, None] * x_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    if GATED:
        gate, up = unpair(acc.to(Out.dtype.element_ty), BLOCK_N // 2, ROWS)
        offs_out = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        out_mask = (offs_out < N // 2)[:, None] & mask_m[None, :]
        gated = (gate * tl.sigmoid(gate) * up).to(Out.dtype.element_ty)
        tl.store(Out + offs_m[None, :] * stride_om + offs_out[:, None], gated, mask=out_mask)
        tl.store(AmaxOut + offs_m * stride_ao + pid_n, tl.max(tl.abs(gated.to(tl.float32)), 0), mask=mask_m)
    elif ROPE:
        rope_store(acc.to(Out.dtype.element_ty), pid_n, offs_m, mask_m, Out, Pos, Loc, CosSin, KCache, VCache,
                   stride_om, stride_c, stride_ct, k_inv_scale, v_inv_scale, BLOCK_N // 2, ROWS, HEADS_Q, HEADS_KV,
                   HALF, KV_QUANT, KV_FP8_MAX)
    else:
        tl.store(Out + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(Out.dtype.element_ty),
                 mask=mask_n[:, None] & mask_m[None, :])


@triton.jit
def rows_block(x, k0, k_end, offs_k, offs_m, mask_m, x_inv_scale, Residual, stride_res, rstd, NormWeight, K,
               QUANTIZE: tl.constexpr, NORM: tl.constexpr, FP8_MAX: tl.constexpr, HW_CAST: tl.constexpr):
    """A K block of the rows as the MMA takes it: quantized here (from the pending RMSNorm with NORM), or as
    loaded."""
    if QUANTIZE:
        if NORM:
            block_mask = mask_m[:, None] & (k0 + offs_k < k_end)[None, :]
            x = normed(residual_sum(x, Residual, block_mask, stride_res, offs_m, k0 + offs_k), rstd, NormWeight,
                       k0 + offs_k, K)
        x = to_e4m3(x.to(tl.float32) * x_inv_scale[:, None], FP8_MAX, HW_CAST)
    return x


@triton.jit
def paired_rows(pid_n, N, GROUP, BLOCK_N: tl.constexpr):
    """The weight rows of block pid_n when each row i of a group of GROUP rows is paired with row i of the group
    after it (a [a; b] pair of groups every 2 * GROUP rows): BLOCK_N // 2 pairs, interleaved a0, b0, a1, b1, ...;
    and the rows' mask (pairs < N // 2)."""
    r = tl.arange(0, BLOCK_N)
    pair = pid_n * (BLOCK_N // 2) + r // 2
    return (pair // GROUP) * (2 * GROUP) + pair % GROUP + (r % 2) * GROUP, pair < N // 2


@triton.jit
def unpair(rows, PAIRS: tl.constexpr, ROWS: tl.constexpr):
    """[2 * PAIRS, ROWS] values of `paired_rows` -> the a and b halves, [PAIRS, ROWS] each, in float32."""
    return tl.split(tl.permute(tl.reshape(rows.to(tl.float32), [PAIRS, 2, ROWS]), [0, 2, 1]))


@triton.jit
def rope_store(qkv, pid_n, offs_m, mask_m, Out, Pos, Loc, CosSin, KCache, VCache, stride_om, stride_c, stride_ct,
               k_inv_scale, v_inv_scale, PAIRS: tl.constexpr, ROWS: tl.constexpr, HEADS_Q: tl.constexpr,
               HEADS_KV: tl.constexpr, HALF: tl.constexpr, KV_QUANT: tl.constexpr, KV_FP8_MAX: tl.constexpr):
    """`qk_norm_rope_store_kv`'s arithmetic (no norm) on block pid_n of a qkv product (rounded to Out's dtype),
    whose PAIRS pairs (i, i + HALF) all lie in one head (PAIRS divides HALF)."""
    a, b = unpair(qkv, PAIRS, ROWS)
    head = pid_n * PAIRS // HALF
    i = (pid_n * PAIRS) % HALF + tl.arange(0, PAIRS)
    if head < HEADS_Q + HEADS_KV:  # q or k: neox rotary at each row's position
        cos_sin = CosSin + tl.load(Pos + offs_m, mask=mask_m, other=0).to(tl.int64)[None, :] * stride_c + i[:, None]
        cos = tl.load(cos_sin, mask=mask_m[None, :], other=1.0).to(tl.float32)
        sin = tl.load(cos_sin + HALF, mask=mask_m[None, :], other=0.0).to(tl.float32)
        a, b = a * cos - b * sin, b * cos + a * sin
    a = a.to(Out.dtype.element_ty)
    b = b.to(Out.dtype.element_ty)
    mask = mask_m[None, :] & (i < HALF)[:, None]
    out = Out + offs_m[None, :] * stride_om + head * (2 * HALF) + i[:, None]
    tl.store(out, a, mask=mask)
    tl.store(out + HALF, b, mask=mask)
    if head >= HEADS_Q:  # k or v: into the cache at the rows' slots
        loc = tl.load(Loc + offs_m, mask=mask_m, other=0).to(tl.int64)[None, :] * stride_ct + i[:, None]
        if head < HEADS_Q + HEADS_KV:
            cache = KCache + loc + (head - HEADS_Q) * (2 * HALF)
            tl.store(cache, to_cache(a, k_inv_scale, KCache, KV_QUANT, KV_FP8_MAX), mask=mask)
            tl.store(cache + HALF, to_cache(b, k_inv_scale, KCache, KV_QUANT, KV_FP8_MAX), mask=mask)
        else:
            cache = VCache + loc + (head - HEADS_Q - HEADS_KV) * (2 * HALF)
            tl.store(cache, to_cache(a, v_inv_scale, VCache, KV_QUANT, KV_FP8_MAX), mask=mask)
            tl.store(cache + HALF, to_cache(b, v_inv_scale, VCache, KV_QUANT, KV_FP8_MAX), mask=mask)
