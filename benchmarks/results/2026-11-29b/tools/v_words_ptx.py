"""Fourteenth session, call 4: the engine's FP8-page decode kernel (head rows, V as words) with the words converted
by inline PTX (`cvt.rn.f16x2.e4m3x2` on each half of a word: no byte extraction and re-pairing; compiled for sm_90
its loop runs 578 instead of 722 instructions a warp per 64-token block) against today's conversion, same harness as
token_rows_sweep.py, one process a variant (the kernel's `_fp8_words_to` is swapped in the module before its first
compile: Triton resolves it then); each output checked against the bf16-page kernel over the same (exactly
converted) values. python benchmarks/results/2026-11-29b/tools/v_words_ptx.py today|ptx OUT.json
"""

import json
import sys
import time

import torch
import triton
import triton.language as tl

from pdserve.bench.decode_sweep import CASES, time_config
from pdserve.bench.kernels import PagedPool
from pdserve.bench.roofline import Ceilings
from pdserve.kernels import attention
from pdserve.kernels.attention import DecodeConfig, decode_attention, decode_config, decode_num_splits


@triton.jit
def words_by_ptx(words, fp8_type: tl.constexpr, dtype: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    h0, h1, h2, h3 = tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 a, lo; "
        "cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
        "=h,=h,=h,=h,r", [words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    return tl.reshape(tl.join(tl.join(h0, h2), tl.join(h1, h3)), [ROWS, COLS]).to(dtype)


SHAPES = [(64, 4, 3), (64, 4, 2), (128, 4, 3), (64, 2, 3), (64, 8, 3), (32, 4, 3)]


def main(variant: str, out_path: str) -> None:
    if variant == "ptx":
        attention._fp8_words_to = words_by_ptx
    ceiling = Ceilings.measure().hbm_gbps
    rows = []
    for name, hq, hkv, batch, lens in [c for c in CASES if c[3] >= 32]:
        if lens is None:
            lens = torch.randint(100, 2049, (batch,), generator=torch.Generator().manual_seed(0)).tolist()
        pool = PagedPool(batch * (max(lens) + 16) + 64, hkv, 128, 16)
        k, v = pool.k.to(torch.float8_e4m3fn), pool.v.to(torch.float8_e4m3fn)
        del pool.k, pool.v
        table = pool.page_table(batch, max(lens))
        seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, hq, 128, device="cuda", dtype=torch.bfloat16)
        bound = decode_num_splits(batch, hkv, q.device)
        ref = torch.empty_like(q)
        decode_attention(q, k.to(torch.bfloat16), v.to(torch.bfloat16), table, seq_lens, ref, 0.088, 16, bound)
        nbytes = sum(lens) * hkv * 128 * 2 + 2 * q.numel() * 2
        engine = decode_config(batch, fp8_cache=True)
        for bn, w, s in SHAPES:
            cfg = DecodeConfig(bn, w, s, engine.min_split_len)
            row = time_config(name, batch, cfg, bound, q, k, v, table, seq_lens, ref, nbytes, ceiling)
            row["variant"] = variant
            rows.append(row)
            print(f"{variant:6s} {name:24s} bn={bn:3d} w={w} s={s} splits={bound:2d} "
                  + (f"{row['us']:8.1f} us {100 * row['frac_copy']:5.1f}% err {row['rel_err']:.1e}" if "us" in row
                     else row["error"][:120]), flush=True)
        del k, v, pool
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "copy_gbps": ceiling,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
