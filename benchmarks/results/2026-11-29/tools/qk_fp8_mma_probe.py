"""Probe for the next FP8 decode kernel (session 13, 2026-11-29): is the QK half of decode attention over FP8 pages
bandwidth-bound when K goes into an FP8 tensor-core MMA as it is (queries split into FP8 high and low parts, K as the
MMA's M side), where today's kernel converts every K byte to fp16 for an fp16 MMA?

Streams only K (half the KV bytes) through the paged layout of the engine (llama-3.1-8b heads, pages of 16, shuffled),
batch 64 x 4k and 32 x 16k, one program per (request, kv head, split), and keeps a running max of the scores so the
products are not optimized away. Prints microseconds and the share of the copy ceiling for K's bytes, and the
scores' error against float64 for one block.

python benchmarks/results/2026-11-29/tools/qk_fp8_mma_probe.py
"""

import torch
import triton
import triton.language as tl
import triton.testing

from pdserve.bench.kernels import PagedPool
from pdserve.bench.roofline import Ceilings


@triton.jit
def qk_converted(Q, K, Table, Out, stride_kt, stride_pb, split_len, GROUP: tl.constexpr, D: tl.constexpr,
                 BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_h = tl.arange(0, 16)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + ((b * tl.num_programs(1) + kvh) * GROUP + offs_h[:, None]) * D + offs_d[None, :],
                mask=offs_h[:, None] < GROUP, other=0.0).to(tl.float16)
    best = tl.full([16], float("-inf"), tl.float32)
    start = split * split_len
    pages = tl.load(Table + b * stride_pb + (start + tl.arange(0, BLOCK_N)) // PAGE)
    for n0 in range(start, start + split_len, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        slot = pages.to(tl.int64) * PAGE + pos % PAGE
        pages = tl.load(Table + b * stride_pb + (pos + BLOCK_N) // PAGE, mask=pos + BLOCK_N < start + split_len,
                        other=0)
        k = tl.load(K + slot[None, :] * stride_kt + kvh * D + offs_d[:, None])
        best = tl.maximum(best, tl.max(tl.dot(q, k.to(tl.float16)), 1))
    tl.store(Out + ((b * tl.num_programs(1) + kvh) * tl.num_programs(2) + split) * 16 + offs_h, best)


@triton.jit
def qk_fp8_mma(QHiLo, K, Table, Out, stride_kt, stride_pb, split_len, D: tl.constexpr, BLOCK_N: tl.constexpr,
               PAGE: tl.constexpr):
    """QHiLo: [B, H_kv, 16, D] FP8: rows 2h and 2h + 1 the high and low parts of query head h of the group (scaled),
    rows past 2 * GROUP zero. The scores are K [BLOCK_N, D] x QHiLo^T [D, 16]: an FP8 MMA with K as its M side."""
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_r = tl.arange(0, 16)
    offs_d = tl.arange(0, D)
    q = tl.load(QHiLo + ((b * tl.num_programs(1) + kvh) * 16 + offs_r[:, None]) * D + offs_d[None, :])
    qt = tl.trans(q)
    best = tl.full([8], float("-inf"), tl.float32)
    start = split * split_len
    pages = tl.load(Table + b * stride_pb + (start + tl.arange(0, BLOCK_N)) // PAGE)
    for n0 in range(start, start + split_len, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        slot = pages.to(tl.int64) * PAGE + pos % PAGE
        pages = tl.load(Table + b * stride_pb + (pos + BLOCK_N) // PAGE, mask=pos + BLOCK_N < start + split_len,
                        other=0)
        k = tl.load(K + slot[:, None] * stride_kt + kvh * D + offs_d[None, :])
        s = tl.dot(k, qt)  # [BLOCK_N, 16] float32
        hi, lo = tl.split(tl.reshape(s, [BLOCK_N, 8, 2]))
        best = tl.maximum(best, tl.max(hi + lo, 0))
    tl.store(Out + ((b * tl.num_programs(1) + kvh) * tl.num_programs(2) + split) * 16 + tl.arange(0, 8), best)


def hi_lo(q: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H_q, D] -> ([B, H_kv, 16, D] FP8 high/low rows, per-head scales [B, H_q]) with q = scale * (hi + lo)."""
    b, hq, d = q.shape
    scale = q.float().abs().amax(-1).clamp(min=1e-12) / 448
    x = q.float() / scale[..., None]
    hi = x.to(torch.float8_e4m3fn)
    lo = (x - hi.float()).to(torch.float8_e4m3fn)
    rows = torch.zeros(b, hq // group, 16, d, dtype=torch.float8_e4m3fn, device=q.device)
    pair = torch.stack([hi, lo], 2).view(b, hq // group, 2 * group, d)
    rows[:, :, : 2 * group] = pair
    return rows, scale


def main():
    ceiling = Ceilings.measure().hbm_gbps
    group, hkv, d = 4, 8, 128
    for batch, ctx, splits in ((64, 4096, 2), (32, 16384, 4)):
        pool = PagedPool(batch * (ctx + 16) + 64, hkv, d, 16)
        k = pool.k.to(torch.float8_e4m3fn)
        del pool.k, pool.v
        table = pool.page_table(batch, ctx)
        q = torch.randn(batch, hkv * group, d, device="cuda", dtype=torch.bfloat16)
        qhl, scale = hi_lo(q, group)
        split_len = ctx // splits
        out = torch.empty(batch * hkv * splits * 16, device="cuda")
        nbytes = batch * ctx * hkv * d
        for name, fn in (
            ("converted fp16 MMA", lambda bn, w, s: qk_converted[(batch, hkv, splits)](
                q, k, table, out, k.stride(0), table.stride(0), split_len, GROUP=group, D=d, BLOCK_N=bn, PAGE=16,
                num_warps=w, num_stages=s)),
            ("FP8 MMA, q high+low", lambda bn, w, s: qk_fp8_mma[(batch, hkv, splits)](
                qhl, k, table, out, k.stride(0), table.stride(0), split_len, D=d, BLOCK_N=bn, PAGE=16, num_warps=w,
                num_stages=s)),
        ):
            for bn, w, s in ((64, 4, 3), (128, 4, 3), (128, 4, 4), (128, 8, 3), (256, 8, 3)):
                try:
                    us = 1e3 * triton.testing.do_bench_cudagraph(lambda: fn(bn, w, s), rep=50, return_mode="median")
                except Exception as e:
                    print(f"{batch}x{ctx} {name} bn={bn} w={w} s={s}: {repr(e)[:150]}", flush=True)
                    continue
                print(f"{batch}x{ctx} {name:22s} bn={bn:3d} w={w} s={s} {us:8.1f} us {100 * nbytes / us / 1e3 / ceiling:5.1f}%"
                      " of the copy ceiling (K bytes)", flush=True)
        # accuracy of the high/low scores for request 0, kv head 0, the first 64 tokens, against float64
        slots = (table[0, :4].long()[:, None] * 16 + torch.arange(16, device="cuda")).flatten()
        kk = k[slots, 0].double()
        exact = q[0, :group].double() @ kk.T
        parts = qhl[0, 0, : 2 * group].double().view(group, 2, d).sum(1)
        approx = (parts @ kk.T) * scale[0, :group, None].double()
        print(f"{batch}x{ctx} high+low scores: max abs error {(approx - exact).abs().max().item():.2e} "
              f"(scores up to {exact.abs().max().item():.1f}); fp16 queries: "
              f"{((q[0, :group].half().double() @ kk.T) - exact).abs().max().item():.2e}", flush=True)


if __name__ == "__main__":
    main()
