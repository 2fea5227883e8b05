"""Per-token FP8 quantization of activations in one Triton kernel on CUDA (the torch ops of
`pdserve.quantization.fp8.quantize_tokens` take ~9 small kernels per linear layer, which inside a decode CUDA
graph cost more than the GEMM's saving at small batches): one program per row loads it once, takes its amax
(or the static scale) and writes the float8 row and its float32 scale."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.quantization.fp8 import FP8, FP8_MAX, MIN_SCALE


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
def _quantize_tokens_kernel(X, Q, Scale, StaticScale, stride_x, stride_q, K, STATIC: tl.constexpr,
                            BLOCK: tl.constexpr):
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


def quantize_tokens_triton(x: torch.Tensor, static_scale: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_tokens` of a 2-D x (last dim contiguous), the same bytes and scales."""
    m, k = x.shape
    assert x.stride(1) == 1
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    _quantize_tokens_kernel[(m,)](
        x, q, scale, static_scale if static_scale is not None else scale, x.stride(0), q.stride(0), k,
        STATIC=static_scale is not None, BLOCK=block, num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16,
    )
    return q, scale
