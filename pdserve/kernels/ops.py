"""Fused elementwise ops: a torch reference and a dispatcher per op (Triton on CUDA when installed, else torch).

Every dispatcher computes the same function as its `*_ref`; the Triton versions round once per output element
(fp32 arithmetic inside), so they agree with the references to the last bit or one unit in the last place.
"""

from __future__ import annotations

import importlib.util

import torch

from pdserve.kernels.fp8_rows import Fp8Output, Fp8Rows, quantize_tokens_ref
from pdserve.mem_cache.kv_quant import write_slots

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _use_triton(x: torch.Tensor) -> bool:
    return HAS_TRITON and x.is_cuda


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (normed.float() * weight.float()).to(x.dtype)
    return out if residual is None else (out, x)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            fp8: Fp8Output | None = None, residual_out: torch.Tensor | None = None):
    """RMSNorm over the last dim, HF-exact: y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype).

    x: [..., N] any float dtype (last dim contiguous); weight: [N]. Inputs are never modified.
    residual=None: returns y (new tensor, x's shape and dtype).
    residual [..., N] given: h = (x + residual) rounded to x.dtype; returns (rmsnorm(h), h), both new tensors;
    h is the residual stream for the next layer (written into residual_out where given, which is then returned).
    fp8 given (the next layer has FP8 weights): y comes as `Fp8Rows` of 2-D rows instead, quantized per token in
    the same kernel (`quantize_tokens` of y: the same bytes and scales).
    """
    if _use_triton(x):
        from pdserve.kernels import fused

        out = fused.rmsnorm(x, weight, eps, residual, fp8, residual_out)
    else:
        out = rmsnorm_ref(x, weight, eps, residual)
        if residual_out is not None:
            out = (out[0], residual_out.copy_(out[1]))
    if fp8 is None:
        return out
    if residual is None:
        return _fp8_rows(out, fp8, x.dtype)
    return _fp8_rows(out[0], fp8, x.dtype), out[1]


def _fp8_rows(out, fp8: Fp8Output, dtype: torch.dtype) -> Fp8Rows:
    """A kernel's quantized (values, scales), or rows the torch path computed in `dtype`, quantized here."""
    if isinstance(out, tuple):
        return Fp8Rows(*out, dtype)
    return Fp8Rows(*quantize_tokens_ref(out.reshape(-1, out.shape[-1]), fp8.static_scale), dtype)


def quantize_tokens(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 [M, K], float32 scales [M, 1]): per token (amax / FP8_MAX), or the static scale. On
    CUDA one Triton kernel computes the same bytes and scales."""
    if _use_triton(x):
        from pdserve.kernels import fused

        return fused.quantize_tokens(x, Fp8Output(static_scale))
    return quantize_tokens_ref(x, static_scale)


def build_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """[max_positions, 2 * len(inv_freq)] fp32: row p = cat(cos(p * inv_freq), sin(p * inv_freq))."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64, device=inv_freq.device), inv_freq.double())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


def apply_rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions).float()
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x[..., : 2 * half] = rotated.to(x.dtype)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Neox-style rotary embedding applied IN PLACE to q and k; returns None.

    positions: [T] int64; q: [T, H_q, D], k: [T, H_kv, D] (views allowed, last dim contiguous);
    cos_sin_cache: [max_pos, R] fp32 (see build_cos_sin_cache), R <= D even: the first R dims of each head
    rotate as pairs (i, i + R/2); dims >= R are untouched. Arithmetic in fp32, one rounding per element.
    """
    if _use_triton(q):
        from pdserve.kernels import fused

        return fused.apply_rotary(positions, q, k, cos_sin_cache)
    return apply_rotary_ref(positions, q, k, cos_sin_cache)


def qk_norm_rope_store_kv_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None, eps: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    if q_norm_weight is not None:
        q.copy_(rmsnorm_ref(q, q_norm_weight, eps))
        k.copy_(rmsnorm_ref(k, k_norm_weight, eps))
    apply_rotary_ref(positions, q, k, cos_sin_cache)
    write_slots(k_cache, loc, k, k_scale)
    write_slots(v_cache, loc, v, v_scale)


def qk_norm_rope_store_kv(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None, eps: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """A layer's new q, k, v in one pass: per-head RMSNorm of q and k (when the norm weights are given), neox
    rotary of q and k IN PLACE, then k_cache[loc[t]] = k[t] (normed and rotated) and v_cache[loc[t]] = v[t].

    q: [T, H_q, D], k, v: [T, H_kv, D] (views of the fused qkv output: last dim contiguous, any token and head
    strides); positions, loc: [T] int64; cos_sin_cache: [max_pos, R] fp32 with R <= D (see apply_rotary);
    k_cache, v_cache: [num_slots, H_kv, D] contiguous (one layer of the KVPool); q_norm_weight, k_norm_weight:
    [D], both or neither. The same numbers as rmsnorm per head, then apply_rotary, then the store: fp32 math,
    rounded to q's dtype after the norm and after the rotation. An FP8 cache stores k and v quantized at the
    layer's k_scale and v_scale (`mem_cache.kv_quant.quantize`: the same numbers in both paths). Returns None.
    """
    assert (q_norm_weight is None) == (k_norm_weight is None), "q and k norm weights come together"
    if _use_triton(q):
        from pdserve.kernels import fused

        return fused.qk_norm_rope_store_kv(
            positions, q, k, v, cos_sin_cache, k_cache, v_cache, loc, q_norm_weight, k_norm_weight, eps, k_scale,
            v_scale,
        )
    return qk_norm_rope_store_kv_ref(
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, loc, q_norm_weight, k_norm_weight, eps, k_scale, v_scale
    )


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    return (torch.nn.functional.silu(x[..., :inter].float()) * x[..., inter:].float()).to(x.dtype)


def silu_and_mul(x: torch.Tensor, fp8: Fp8Output | None = None):
    """x: [..., 2I] = cat(gate, up) -> new tensor [..., I] = silu(gate) * up (fp32 math, x's dtype); with fp8 (the
    next layer has FP8 weights) as `Fp8Rows` of 2-D rows, quantized per token in the same kernel."""
    if _use_triton(x):
        from pdserve.kernels import fused

        out = fused.silu_and_mul(x, fp8)
    else:
        out = silu_and_mul_ref(x)
    return out if fp8 is None else _fp8_rows(out, fp8, x.dtype)
