"""Block-shape sweep of the paged split-KV decode kernel on one CUDA GPU, against the measured copy ceiling.

python -m pdserve.bench.decode_sweep --out FILE.json [--kv-dtype fp8_e4m3]
Cases are the engine's: llama-3.1-8b heads (32 q / 8 kv) at batch 1, 8 and 64 (1k and 4k contexts) and at 16k
(batch 32 and 64), qwen3-0.6b heads (16 / 8) at batch 256 with uniform and mixed context lengths. Each config's
output is checked against the default's. With `--kv-dtype fp8_e4m3` the cache holds FP8 (half the bytes a token; wider KV blocks join the sweep).
From batch 16 up the split bound doubles and quadruples too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import triton.testing

from pdserve.bench.cli import bench_parser
from pdserve.bench.kernels import PagedPool
from pdserve.bench.roofline import Ceilings
from pdserve.kernels.attention import (DECODE_MAX_SPLITS, DecodeConfig, decode_attention, decode_num_splits,
                                      decode_workspace)

BF16 = torch.bfloat16
CASES = [  # name, q heads, kv heads, batch, context lengths (a list: one per request)
    ("llama bs1 ctx1024", 32, 8, 1, [1024]),
    ("llama bs1 ctx8192", 32, 8, 1, [8192]),
    ("llama bs8 ctx1024", 32, 8, 8, [1024] * 8),
    ("llama bs64 ctx1024", 32, 8, 64, [1024] * 64),
    ("llama bs64 ctx4096", 32, 8, 64, [4096] * 64),
    ("llama bs32 ctx16384", 32, 8, 32, [16384] * 32),
    ("llama bs64 ctx16384", 32, 8, 64, [16384] * 64),
    ("qwen bs256 ctx600", 16, 8, 256, [600] * 256),
    ("qwen bs256 ctx100-2048", 16, 8, 256, None),
]


def configs(batch: int, kv_dtype: torch.dtype) -> list[DecodeConfig]:
    splits = (64, 128, 256) if batch <= 8 else (256,)
    blocks = (32, 64, 128, 256) if kv_dtype.itemsize == 1 else (32, 64, 128)
    stages = (2, 3, 4)
    warps = (2, 4, 8) if kv_dtype.itemsize == 1 else (4, 8)  # FP8: more resident programs for its longer loop
    return [DecodeConfig(bn, w, s, ms) for bn, w, s, ms in itertools.product(blocks, warps, stages, splits)]


def split_bounds(batch: int, num_kv_heads: int, cfg: DecodeConfig) -> list[int]:
    """The engine's split bound, and from batch 16 up (where it covers the GPU only a few times) two and four
    times it at 4 warps."""
    bound = decode_num_splits(batch, num_kv_heads, torch.device("cuda"))
    if batch <= 8 or cfg.num_warps != 4:
        return [bound]
    return [b for b in (bound, 2 * bound, 4 * bound) if b <= DECODE_MAX_SPLITS]


def run_case(name, hq, hkv, batch, lens, ceiling_gbps, kv_dtype) -> list[dict]:
    if lens is None:
        gen = torch.Generator().manual_seed(0)
        lens = torch.randint(100, 2049, (batch,), generator=gen).tolist()
    pool = PagedPool(batch * (max(lens) + 16) + 64, hkv, 128, 16)
    k_cache, v_cache = pool.k.to(kv_dtype), pool.v.to(kv_dtype)
    del pool.k, pool.v
    table = pool.page_table(batch, max(lens))
    seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, hq, 128, device="cuda", dtype=BF16)
    ref = torch.empty_like(q)
    decode_attention(q, k_cache, v_cache, table, seq_lens, ref, 0.088, 16, decode_num_splits(batch, hkv, q.device),
                     config=DecodeConfig())
    nbytes = sum(lens) * hkv * 128 * 2 * kv_dtype.itemsize + 2 * q.numel() * 2
    rows = []
    for cfg in configs(batch, kv_dtype):
        for splits in split_bounds(batch, hkv, cfg):
            rows.append(time_config(name, batch, cfg, splits, q, k_cache, v_cache, table, seq_lens, ref, nbytes,
                                    ceiling_gbps))
    return rows


def time_config(name, batch, cfg, splits, q, k_cache, v_cache, table, seq_lens, ref, nbytes, ceiling_gbps) -> dict:
    workspace = decode_workspace(batch, q.shape[1], k_cache.shape[1], q.shape[2], splits, q.device)
    out = torch.full_like(q, float("nan"))

    def fn():
        decode_attention(q, k_cache, v_cache, table, seq_lens, out, 0.088, 16, splits, workspace, cfg)

    try:
        fn()
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        us = 1e3 * triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")
    except Exception as e:  # a block shape the compiler rejects is a result
        return dict(case=name, config=cfg.__repr__(), max_splits=splits, error=repr(e)[:200])
    return dict(case=name, batch=batch, block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                min_split_len=cfg.min_split_len, max_splits=splits, us=us, gbps=nbytes / us / 1e3,
                frac_copy=nbytes / us / 1e3 / ceiling_gbps, rel_err=err)


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__)
    parser.add_argument("--out", required=True, help="the JSON file of every configuration's timing")
    parser.add_argument("--kv-dtype", choices=["bf16", "fp8_e4m3"], default="bf16", help="the KV cache's dtype")
    parser.add_argument("--cases", nargs="*", help="only the cases whose name contains one of these")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    ceiling = Ceilings.measure().hbm_gbps
    kv_dtype = {"bf16": BF16, "fp8_e4m3": torch.float8_e4m3fn}[args.kv_dtype]
    rows = []
    for case in CASES:
        if args.cases and not any(part in case[0] for part in args.cases):
            continue
        t = time.perf_counter()
        case_rows = run_case(*case, ceiling, kv_dtype)
        rows += case_rows
        ok = [r for r in case_rows if "us" in r and r["rel_err"] < 2e-2]
        default = min((r for r in ok if (r["block_n"], r["num_warps"], r["num_stages"]) == (64, 4, 2)
                       and r["min_split_len"] == 256), key=lambda r: r["max_splits"])
        best = min(ok, key=lambda r: r["us"])
        bad = [r for r in case_rows if "error" in r or r.get("rel_err", 0) >= 2e-2]
        print(f"{case[0]:24s} default {default['us']:8.1f} us ({100 * default['frac_copy']:4.1f}%)  best "
              f"{best['us']:8.1f} us ({100 * best['frac_copy']:4.1f}%) bn={best['block_n']} w={best['num_warps']} "
              f"s={best['num_stages']} split={best['min_split_len']} splits<={best['max_splits']}  failed {len(bad)}"
              f"  [{time.perf_counter() - t:.0f} s]")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                   "kv_dtype": args.kv_dtype, "copy_gbps": ceiling, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
