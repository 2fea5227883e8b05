"""Per-token FP8 quantization of activations in one Triton kernel, launched on CUDA by
`pdserve.quantization.fp8.quantize_tokens_triton` instead of its torch ops (about 9 small kernels per linear
layer, each one more launch in the decode CUDA graphs): one program per row loads it once, takes its amax (or the
static scale) and writes the float8 row and its float32 scale."""

from __future__ import annotations

import triton
import triton.language as tl

from pdserve.kernels.skinny_triton import load_blocks


@triton.jit
def _round_to_e4m3(v):
    """v (|v| <= 448) rounded to the nearest E4M3 value, ties to even: the spacing is 2^(exponent - 3), at least
    2^-9 (subnormals); |v| / spacing < 16, where adding and subtracting 2^23 rounds to an integer, ties to even.
    The sign bit is v's (a negative value rounding to zero is -0, as torch's cast gives)."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    spacing = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    per_spacing = ((127 - exponent + 3) << 23).to(tl.float32, bitcast=True)  # 1 / spacing, exact
    magnitude = ((tl.abs(v) * per_spacing + 8388608.0) - 8388608.0) * spacing
    return (magnitude.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def quantize_tokens_kernel(X, Q, Scale, StaticScale, stride_x, stride_q, K, FP8_MAX: tl.constexpr,
                           INV_FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, STATIC: tl.constexpr,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if STATIC:
        scale = tl.load(StaticScale)
    else:
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) * INV_FP8_MAX, MIN_SCALE)
    v = tl.minimum(tl.maximum(x * tl.div_rn(1.0, scale), -FP8_MAX), FP8_MAX)
    # rounded here, so the cast is exact: the bytes torch's cast gives (Triton's interpreter rounds a value that
    # carries into the next power of two wrongly)
    tl.store(Q + row * stride_q + offs, _round_to_e4m3(v).to(Q.dtype.element_ty), mask=mask)
    tl.store(Scale + row, scale)


@triton.jit(do_not_specialize=["M"])  # the batch's rows, a mask bound: one variant for every batch size
def skinny_fp8_kernel(
    X, W, WScale, StaticScale, B, Out, M, N, K, stride_xm, stride_wn, stride_om,
    FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, STATIC: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
):
    """`quantize_tokens_kernel` and the FP8 product in one, on the CUDA cores: output columns
    [pid * BLOCK_N, +BLOCK_N) of the M <= ROWS rows. Each program takes the rows' amax (a pass over X, which is small
    and stays in L2), quantizes each X block as it streams the FP8 weight block once, multiplies in float32 (every
    product of two E4M3 values is exact there) and scales the sums by the row's and the column's scales. For a few
    rows the weight read is the bound; an MMA tile would pad the rows to 16 and quantize the padding too."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, ROWS)
    mask_m = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    if STATIC:
        x_scale = tl.zeros([ROWS], dtype=tl.float32) + tl.load(StaticScale)
    else:
        amax = tl.zeros([ROWS], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            in_k = (k0 + offs_k) < K
            x = tl.load(x_ptrs + k0, mask=mask_m[:, None] & in_k[None, :], other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        x_scale = tl.maximum(amax * INV_FP8_MAX, MIN_SCALE)
    x_inv_scale = tl.div_rn(tl.full([ROWS], 1.0, tl.float32), x_scale)
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    partial = tl.zeros([ROWS, BLOCK_N, BLOCK_K], dtype=tl.float32)  # summed across threads once, after the loop
    for k0 in range(0, K, BLOCK_K):
        w, x = load_blocks(w_ptrs, x_ptrs, mask_n, mask_m, k0 + offs_k < K, EVEN_K)
        v = tl.minimum(tl.maximum(x.to(tl.float32) * x_inv_scale[:, None], -FP8_MAX), FP8_MAX)
        partial += _round_to_e4m3(v)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    acc = tl.sum(partial, axis=2) * x_scale[:, None] * tl.load(WScale + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = Out + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
