"""Probe, the other half (session 13, 2026-11-29): the PV product of decode attention over FP8 pages, V streamed
through the engine's paged layout (llama-3.1-8b heads, pages of 16, shuffled), batch 64 x 4k and 32 x 16k, with fixed
probabilities, in the ways V can reach an fp16 MMA:
  words   V as 32-bit words in registers, unpacked by shifts (today's kernel, `_fp8_words_to`)
  asm     V's bytes in registers, two converted per instruction by inline PTX (cvt.rn.f16x2.e4m3x2)
  direct  V's FP8 tile handed to the dot, converted by Triton (byte-wise transposed shared-memory loads on sm_90)
  bf16    a bf16 V of the same tokens (twice the bytes): the bound a 16-bit V reaches
Prints microseconds and the share of the copy ceiling for V's bytes.

python benchmarks/results/2026-11-29/tools/pv_fp8_probe.py
"""

import torch
import triton
import triton.language as tl
import triton.testing

from pdserve.bench.kernels import PagedPool
from pdserve.bench.roofline import Ceilings


@triton.jit
def _words_to_f16(words, ROWS: tl.constexpr, COLS: tl.constexpr):
    b0 = (words & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    b1 = ((words >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    b2 = ((words >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    b3 = ((words >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), [ROWS, COLS])


@triton.jit
def _asm_to_f16(values):
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [values], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def pv(V, Table, Out, stride_vt, stride_pb, split_len, D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
       MODE: tl.constexpr):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_d = tl.arange(0, D)
    p = (tl.zeros([16, BLOCK_N], tl.float32) + 1.0 / 4096).to(tl.float16)
    acc = tl.zeros([16, D], tl.float32)
    start = split * split_len
    pages = tl.load(Table + b * stride_pb + (start + tl.arange(0, BLOCK_N)) // PAGE)
    for n0 in range(start, start + split_len, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        slot = pages.to(tl.int64) * PAGE + pos % PAGE
        pages = tl.load(Table + b * stride_pb + (pos + BLOCK_N) // PAGE, mask=pos + BLOCK_N < start + split_len,
                        other=0)
        if MODE == 0:  # words
            words = tl.load(V + slot[:, None] * stride_vt + kvh * (D // 4) + tl.arange(0, D // 4)[None, :])
            v = _words_to_f16(words, BLOCK_N, D)
        elif MODE == 1:  # asm
            v = _asm_to_f16(tl.load(V + slot[:, None] * stride_vt + kvh * D + offs_d[None, :]))
        elif MODE == 2:  # direct
            v = tl.load(V + slot[:, None] * stride_vt + kvh * D + offs_d[None, :]).to(tl.float16)
        if MODE == 3:  # bf16, as loaded
            acc = tl.dot(p.to(tl.bfloat16), tl.load(V + slot[:, None] * stride_vt + kvh * D + offs_d[None, :]), acc)
        else:
            acc = tl.dot(p, v, acc)
    out = Out + ((b * tl.num_programs(1) + kvh) * tl.num_programs(2) + split) * 16 * D
    tl.store(out + tl.arange(0, 16)[:, None] * D + offs_d[None, :], acc)


def main():
    ceiling = Ceilings.measure().hbm_gbps
    hkv, d = 8, 128
    for batch, ctx, splits in ((64, 4096, 2), (32, 16384, 4)):
        pool = PagedPool(batch * (ctx + 16) + 64, hkv, d, 16)
        v16 = pool.v
        v8 = v16.to(torch.float8_e4m3fn)
        del pool.k
        table = pool.page_table(batch, ctx)
        split_len = ctx // splits
        outs = {}
        for mode, name in enumerate(("words", "asm", "direct", "bf16")):
            cache = v8.view(torch.int32) if mode == 0 else v8.view(torch.uint8) if mode == 1 else v8 if mode == 2 else v16
            out = torch.empty(batch * hkv * splits * 16 * d, device="cuda")
            nbytes = batch * ctx * hkv * d * (2 if mode == 3 else 1)
            for bn, w, s in ((64, 4, 3), (64, 4, 2), (128, 4, 3), (128, 8, 3)):
                def fn():
                    pv[(batch, hkv, splits)](cache, table, out, cache.stride(0), table.stride(0), split_len, D=d,
                                             BLOCK_N=bn, PAGE=16, MODE=mode, num_warps=w, num_stages=s)
                try:
                    us = 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
                except Exception as e:
                    print(f"{batch}x{ctx} {name} bn={bn} w={w} s={s}: {repr(e)[:150]}", flush=True)
                    continue
                outs.setdefault(name, out.clone())
                print(f"{batch}x{ctx} {name:6s} bn={bn:3d} w={w} s={s} {us:8.1f} us "
                      f"{100 * nbytes / us / 1e3 / ceiling:5.1f}% of the copy ceiling (V bytes)", flush=True)
        ref = outs.get("direct")
        for name, o in outs.items():
            if ref is not None:
                print(f"{batch}x{ctx} {name} vs direct: max abs diff {(o - ref).abs().max().item():.2e}", flush=True)
        del pool, v16, v8
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
