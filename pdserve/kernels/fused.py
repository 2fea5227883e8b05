"""Triton kernels for the fused elementwise ops; ops.py holds the public wrappers and the torch references."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    X, Res, W, Out, ResOut, n_rows, stride_x, stride_r, stride_o, stride_ro, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
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
    y = (x * rstd[:, None]).to(Out.dtype.element_ty).to(tl.float32) * w[None, :]
    tl.store(Out + rows[:, None] * stride_o + cols[None, :], y.to(Out.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n)
    block = triton.next_power_of_2(n)
    rows_per_prog = max(1, min(16, 2048 // block))
    grid = (triton.cdiv(x2.shape[0], rows_per_prog),)
    if residual is None:
        _rmsnorm_kernel[grid](
            x2, x2, weight, out2, out2, x2.shape[0], x2.stride(0), 0, out2.stride(0), 0, eps,
            N=n, BLOCK=block, ROWS=rows_per_prog, HAS_RESIDUAL=False, num_warps=4 if block <= 2048 else 8,
        )
        return out
    r2 = residual.reshape(-1, n)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res2 = new_residual.view(-1, n)
    _rmsnorm_kernel[grid](
        x2, r2, weight, out2, res2, x2.shape[0], x2.stride(0), r2.stride(0), out2.stride(0), res2.stride(0), eps,
        N=n, BLOCK=block, ROWS=rows_per_prog, HAS_RESIDUAL=True, num_warps=4 if block <= 2048 else 8,
    )
    return out, new_residual


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
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(Out + row * stride_o + cols, out.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    if x2.shape[0] == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
        x2, out2, x2.stride(0), out2.stride(0), INTER=inter, BLOCK=block, num_warps=4,
    )
    return out
