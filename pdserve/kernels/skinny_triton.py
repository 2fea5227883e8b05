"""The Triton kernel behind pdserve.kernels.skinny (imports Triton)."""

from __future__ import annotations

import triton
import triton.language as tl

from pdserve.kernels.pdl import launch_next, wait_for_previous


@triton.jit
def load_blocks(w_ptrs, x_ptrs, mask_n, mask_m, in_k, EVEN_K: tl.constexpr):
    """One K block of the weight rows [BLOCK_N, BLOCK_K] and of the activation rows [ROWS, BLOCK_K], zero outside
    the rows (and outside K unless EVEN_K)."""
    if EVEN_K:
        return tl.load(w_ptrs, mask=mask_n[:, None], other=0.0), tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
    return (tl.load(w_ptrs, mask=mask_n[:, None] & in_k[None, :], other=0.0),
            tl.load(x_ptrs, mask=mask_m[:, None] & in_k[None, :], other=0.0))


@triton.jit(do_not_specialize=["M"])  # the batch's rows, a mask bound: one variant for every batch size
def skinny_kernel(
    X, W, B, Out, M, N, K, stride_xm, stride_wn, stride_om,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: output columns [pid * BLOCK_N, +BLOCK_N) of every row; the M <= ROWS rows ride in one MMA tile,
    so the weight block is read from memory once whatever M is. PDL: see `pdserve.kernels.pdl`."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    wait_for_previous(PDL)
    offs_m = tl.arange(0, ROWS)
    mask_m = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w, x = load_blocks(w_ptrs, x_ptrs, mask_n, mask_m, k0 + offs_k < K, EVEN_K)
        acc = tl.dot(x, tl.trans(w), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    launch_next(PDL)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = Out + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
