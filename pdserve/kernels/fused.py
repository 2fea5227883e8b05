"""Triton kernels for the fused elementwise ops; ops.py holds the public wrappers and the torch references."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8_rows import Fp8Output
from pdserve.kernels.pdl import launch_options, start_dependent
from pdserve.mem_cache.kv_quant import float32, fp8_max, is_fp8


@triton.jit
def round_to_e4m3(v):
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
def to_e4m3(v, FP8_MAX: tl.constexpr, HW_CAST: tl.constexpr):
    """float32 values (already divided by their scale) -> E4M3, saturating at +-FP8_MAX, ties to even: on a GPU the
    hardware conversion (`cvt.rn.satfinite`, two values an instruction), in the interpreter, which rounds a value
    that carries into the next power of two wrongly, clamped and rounded by `round_to_e4m3` first."""
    if HW_CAST:
        return v.to(tl.float8e4nv)
    return round_to_e4m3(tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)).to(tl.float8e4nv)


@triton.jit
def store_fp8_rows(y, rows, cols, mask, n_rows, QOut, QScale, StaticScale, stride_q, FP8_MAX: tl.constexpr,
                   INV_FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, STATIC: tl.constexpr, HW_CAST: tl.constexpr):
    """Rows y [R, BLOCK] (float32, zero outside mask) quantized per row into QOut (E4M3) with their scales in
    QScale: amax * INV_FP8_MAX (at least MIN_SCALE) or the static scale, values times the scale's float32
    reciprocal (`to_e4m3`), so every kernel writes the bytes and scales of `fp8_rows.quantize_tokens_ref`."""
    if STATIC:
        scale = tl.zeros_like(tl.max(y, 1)) + tl.load(StaticScale)
    else:
        scale = tl.maximum(tl.max(tl.abs(y), 1) * INV_FP8_MAX, MIN_SCALE)
    v = y * tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None]
    tl.store(QOut + rows[:, None] * stride_q + cols[None, :], to_e4m3(v, FP8_MAX, HW_CAST), mask=mask)
    tl.store(QScale + rows, scale, mask=rows < n_rows)


def _scale_pointers(fp8: Fp8Output | None, scales: torch.Tensor | None, unused: torch.Tensor) -> tuple:
    """A quantizing launch's QScale and StaticScale arguments: the row scales it writes and the static scale it
    reads (the row scales again where dynamic: unread); any tensor for a launch that does not quantize."""
    if fp8 is None:
        return unused, unused
    return scales, scales if fp8.static_scale is None else fp8.static_scale


@triton.jit
def _quantize_tokens_kernel(X, Q, Scale, StaticScale, stride_x, stride_q, K, FP8_MAX: tl.constexpr,
                            INV_FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, STATIC: tl.constexpr,
                            HW_CAST: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    start_dependent(PDL)
    rows = tl.program_id(0) + tl.arange(0, 1)
    cols = tl.arange(0, BLOCK)
    mask = (cols < K)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    store_fp8_rows(x, rows, cols, mask, rows + 1, Q, Scale, StaticScale, stride_q, FP8_MAX, INV_FP8_MAX, MIN_SCALE,
                   STATIC, HW_CAST)


def quantize_tokens(x: torch.Tensor, fp8: Fp8Output) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.quantize_tokens` of a 2-D x in one launch instead of its torch ops (about 9 small kernels a linear
    layer, each one more launch in the decode CUDA graphs): the same bytes and scales."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q, scale = fp8.empty(m, k, x.device)
    block = triton.next_power_of_2(k)
    _quantize_tokens_kernel[(m,)](
        x, q, *_scale_pointers(fp8, scale, x), x.stride(0), q.stride(0), k, **fp8.constants(x.device), BLOCK=block,
        num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16, **launch_options(x.device),
    )
    return q, scale


@triton.jit(do_not_specialize=["n_rows"])  # the token count, a mask bound: one variant for every count
def _rmsnorm_kernel(
    X, Res, W, Out, ResOut, QScale, StaticScale, n_rows, stride_x, stride_r, stride_o, stride_ro, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, STATIC: tl.constexpr,
    HW_CAST: tl.constexpr, PDL: tl.constexpr,
):
    """QUANT: Out is FP8 and takes the normed rows quantized per row (`store_fp8_rows`), their scales in QScale."""
    start_dependent(PDL)
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(Res + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(ResOut.dtype.element_ty)
        tl.store(ResOut + rows[:, None] * stride_ro + cols[None, :], h, mask=mask)
        x = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / N + eps)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = ((x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32) * w[None, :]).to(X.dtype.element_ty)
    if QUANT:
        store_fp8_rows(y.to(tl.float32), rows, cols, mask, n_rows, Out, QScale, StaticScale, stride_o, FP8_MAX,
                       INV_FP8_MAX, MIN_SCALE, STATIC, HW_CAST)
    else:
        tl.store(Out + rows[:, None] * stride_o + cols[None, :], y, mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            fp8: Fp8Output | None = None, residual_out: torch.Tensor | None = None):
    """`ops.rmsnorm`; with fp8, the normed rows come out quantized per row: (values, scales) in place of them."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if fp8 is None:
        out2, scale = torch.empty_like(x2), None
    else:
        out2, scale = fp8.empty(x2.shape[0], n, x.device)
    block = triton.next_power_of_2(n)
    rows_per_prog = max(1, min(16, 2048 // block))
    grid = (triton.cdiv(x2.shape[0], rows_per_prog),)
    r2 = x2 if residual is None else residual.reshape(-1, n)
    res2 = x2 if residual is None else torch.empty_like(x2) if residual_out is None else residual_out.view(-1, n)
    _rmsnorm_kernel[grid](
        x2, r2, weight, out2, res2, *_scale_pointers(fp8, scale, x2), x2.shape[0],
        x2.stride(0), r2.stride(0), out2.stride(0), res2.stride(0), eps, N=n, BLOCK=block, ROWS=rows_per_prog,
        HAS_RESIDUAL=residual is not None, QUANT=fp8 is not None, **Fp8Output.constants_of(fp8, x.device),
        num_warps=4 if block <= 2048 else 8, **launch_options(x.device),
    )
    out = out2.view(x.shape) if fp8 is None else (out2, scale)
    return out if residual is None else (out, res2.view(x.shape))


@triton.jit
def _rotate_heads(X, t, cos, sin, stride_t, stride_h, offs_d, mask_d,
                  HEADS: tl.constexpr, BLOCK_HEADS: tl.constexpr, HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_HEADS)
    mask = (heads < HEADS)[:, None] & mask_d[None, :]
    ptr1 = X + t * stride_t + heads[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr1, (x1 * cos[None, :] - x2 * sin[None, :]).to(X.dtype.element_ty), mask=mask)
    tl.store(ptr1 + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    Pos, Q, K, Cache, stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
    HQ: tl.constexpr, HK: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(Cache + pos * stride_c + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(Cache + pos * stride_c + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    _rotate_heads(Q, t, cos, sin, stride_qt, stride_qh, offs_d, mask_d, HQ, BLOCK_HQ, HALF)
    _rotate_heads(K, t, cos, sin, stride_kt, stride_kh, offs_d, mask_d, HK, BLOCK_HK, HALF)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.stride(1) == 1
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    half = cos_sin_cache.shape[1] // 2
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        HQ=q.shape[1], HK=k.shape[1], BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]), HALF=half, BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
    )


@triton.jit
def _norm_rope_heads(X, NormW, t, cos, sin, partner, first_half, rotates, stride_t, stride_h, eps,
                     HEADS: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     HAS_NORM: tl.constexpr):
    """Heads [HEADS, D] of token t: RMSNorm (HAS_NORM) then neox rotary, written back in place; returns them.

    Each element reads its rotation partner with a second, cached load instead of splitting the tile in halves,
    so the norm reduces whole rows the way _rmsnorm_kernel does (same rounding, same summation shape)."""
    heads = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (heads < HEADS)[:, None] & (offs_d < D)[None, :]
    row = X + t * stride_t + heads[:, None] * stride_h
    x = tl.load(row + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
        w = tl.load(NormW + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        wp = tl.load(NormW + partner, mask=offs_d < D, other=0.0).to(tl.float32)
        x = ((x * rstd).to(X.dtype.element_ty).to(tl.float32) * w[None, :]).to(X.dtype.element_ty).to(tl.float32)
        xp = ((xp * rstd).to(X.dtype.element_ty).to(tl.float32) * wp[None, :]).to(X.dtype.element_ty).to(tl.float32)
    rotated = tl.where(first_half[None, :], x * cos[None, :] - xp * sin[None, :], x * cos[None, :] + xp * sin[None, :])
    out = tl.where(rotates[None, :], rotated, x).to(X.dtype.element_ty)
    tl.store(row + offs_d[None, :], out, mask=mask)
    return out


@triton.jit
def to_cache(x, inv_scale, Cache, QUANT: tl.constexpr, FP8_MAX: tl.constexpr):
    """Heads as the cache stores them: cast, or for an FP8 cache x * inv_scale clamped to the format's range."""
    if QUANT:
        x = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -FP8_MAX), FP8_MAX)
    return x.to(Cache.dtype.element_ty)


@triton.jit
def _qk_norm_rope_store_kv_kernel(
    Pos, Loc, Q, K, V, Cache, QNormW, KNormW, KCache, VCache,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_c, stride_ct, eps,
    k_inv_scale, v_inv_scale,
    HQ: tl.constexpr, HK: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
    QUANT: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr,
):
    """Program (t, part): part 0 normalizes and rotates token t's q heads, part 1 its k heads and stores them
    into KCache, part 2 copies its v heads into VCache (an FP8 cache: quantized at the layer's scales)."""
    start_dependent(PDL)
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    kv_heads = tl.arange(0, BLOCK_HK)
    kv_mask = (kv_heads < HK)[:, None] & (offs_d < D)[None, :]
    cache_offs = tl.load(Loc + t).to(tl.int64) * stride_ct + kv_heads[:, None] * D + offs_d[None, :]
    if part == 2:
        v = tl.load(V + t * stride_vt + kv_heads[:, None] * stride_vh + offs_d[None, :], mask=kv_mask)
        tl.store(VCache + cache_offs, to_cache(v, v_inv_scale, VCache, QUANT, FP8_MAX), mask=kv_mask)
    else:
        first_half = offs_d < HALF
        rotates = offs_d < 2 * HALF
        partner = tl.where(first_half, offs_d + HALF, tl.where(rotates, offs_d - HALF, offs_d))
        pair = tl.where(first_half, offs_d, offs_d - HALF)
        cos_sin = Cache + tl.load(Pos + t).to(tl.int64) * stride_c + pair
        cos = tl.load(cos_sin, mask=rotates, other=1.0).to(tl.float32)
        sin = tl.load(cos_sin + HALF, mask=rotates, other=0.0).to(tl.float32)
        if part == 0:
            _norm_rope_heads(Q, QNormW, t, cos, sin, partner, first_half, rotates, stride_qt, stride_qh, eps,
                             HQ, BLOCK_HQ, D, BLOCK_D, HAS_NORM)
        else:
            k = _norm_rope_heads(K, KNormW, t, cos, sin, partner, first_half, rotates, stride_kt, stride_kh, eps,
                                 HK, BLOCK_HK, D, BLOCK_D, HAS_NORM)
            tl.store(KCache + cache_offs, to_cache(k, k_inv_scale, KCache, QUANT, FP8_MAX), mask=kv_mask)


def qk_norm_rope_store_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, loc, q_norm_weight=None,
                          k_norm_weight=None, eps=0.0, k_scale=1.0, v_scale=1.0) -> None:
    num_tokens, num_kv_heads, dim = k.shape
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and cos_sin_cache.stride(1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.stride(0) == num_kv_heads * dim
    assert cos_sin_cache.shape[1] <= dim
    if num_tokens == 0:
        return
    has_norm = q_norm_weight is not None
    quant = is_fp8(k_cache.dtype)
    block_hq, block_d = triton.next_power_of_2(q.shape[1]), triton.next_power_of_2(dim)
    _qk_norm_rope_store_kv_kernel[(num_tokens, 3)](
        positions, loc, q, k, v, cos_sin_cache, q_norm_weight if has_norm else q, k_norm_weight if has_norm else k,
        k_cache, v_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0), k_cache.stride(0), eps, float32(1.0 / k_scale), float32(1.0 / v_scale),
        HQ=q.shape[1], HK=num_kv_heads, BLOCK_HQ=block_hq, BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        D=dim, BLOCK_D=block_d, HALF=cos_sin_cache.shape[1] // 2, HAS_NORM=has_norm,
        QUANT=quant, FP8_MAX=fp8_max(k_cache.dtype) if quant else 0.0,
        num_warps=4 if block_hq * block_d <= 4096 else 8, **launch_options(q.device),
    )


@triton.jit(do_not_specialize=["n_rows"])  # the token count, a mask bound: one variant for every count
def _silu_and_mul_kernel(X, Out, QScale, StaticScale, n_rows, stride_x, stride_o, INTER: tl.constexpr,
                         BLOCK: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr,
                         MIN_SCALE: tl.constexpr, STATIC: tl.constexpr, HW_CAST: tl.constexpr, PDL: tl.constexpr):
    """QUANT: one program a row (BLOCK >= INTER); Out is FP8 and takes the row quantized (`store_fp8_rows`)."""
    start_dependent(PDL)
    rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (cols < INTER)[None, :]
    gate = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + rows[:, None] * stride_x + INTER + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = (gate * tl.sigmoid(gate) * up).to(X.dtype.element_ty)
    if QUANT:
        store_fp8_rows(out.to(tl.float32), rows, cols, mask, n_rows, Out, QScale, StaticScale, stride_o, FP8_MAX,
                       INV_FP8_MAX, MIN_SCALE, STATIC, HW_CAST)
    else:
        tl.store(Out + rows[:, None] * stride_o + cols[None, :], out, mask=mask)


def silu_and_mul(x: torch.Tensor, fp8: Fp8Output | None = None):
    """`ops.silu_and_mul`; with fp8, the rows come out quantized per row: (values, scales) in place of them."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if fp8 is None:
        out2, scale = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device), None
    else:
        out2, scale = fp8.empty(x2.shape[0], inter, x.device)
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(inter) if fp8 else min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out2, *_scale_pointers(fp8, scale, x2), x2.shape[0], x2.stride(0),
            out2.stride(0), INTER=inter, BLOCK=block, QUANT=fp8 is not None, **Fp8Output.constants_of(fp8, x.device),
            num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16, **launch_options(x.device),
        )
    return out2.view(*x.shape[:-1], inter) if fp8 is None else (out2, scale)
