"""Per-token FP8 quantization of activations in one Triton kernel, launched on CUDA by
`pdserve.quantization.fp8.quantize_tokens_triton` instead of its torch ops (about 9 small kernels per linear
layer, each one more launch in the decode CUDA graphs): one program per row loads it once, takes its amax (or the
static scale) and writes the float8 row and its float32 scale."""

from __future__ import annotations

import triton
import triton.language as tl


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
                           MIN_SCALE: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if STATIC:
        scale = tl.load(StaticScale)
    else:
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=0), FP8_MAX), MIN_SCALE)
    v = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX), FP8_MAX)
    # rounded here, so the cast is exact: the bytes torch's cast gives (Triton's interpreter rounds a value that
    # carries into the next power of two wrongly)
    tl.store(Q + row * stride_q + offs, _round_to_e4m3(v).to(Q.dtype.element_ty), mask=mask)
    tl.store(Scale + row, scale)
