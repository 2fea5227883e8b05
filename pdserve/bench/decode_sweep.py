"""Block-shape sweep of the paged split-KV decode kernel on one CUDA GPU, against the measured copy ceiling.

python -m pdserve.bench.decode_sweep --out FILE.json [--kv-dtype fp8_e4m3] [--cases NAME ...]
Cases are the engine's: llama-3.1-8b heads (32 q / 8 kv) at batch 1, 8 and 64 (1k and 4k contexts), qwen3-0.6b
heads (16 / 8) at batch 256 with uniform and mixed context lengths. Each config's output is checked against the
default's. With `--kv-dtype fp8_e4m3` the cache holds FP8 (half the bytes a token; wider KV blocks join the sweep)
and DecodeConfig's FP8 variants (fp8_bits, cuda_cores, k_rows) are swept too; each row of the JSON records its
flags, and the log gives the best config of every flag combination under the case's default and best.
`--cases` keeps the cases whose name contains one of its arguments, e.g. `--cases "llama bs64 ctx4096"`.
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
from pdserve.kernels.attention import DecodeConfig, decode_attention, decode_num_splits, decode_workspace

BF16 = torch.bfloat16
CASES = [  # name, q heads, kv heads, batch, context lengths (a list: one per request)
    ("llama bs1 ctx1024", 32, 8, 1, [1024]),
    ("llama bs1 ctx8192", 32, 8, 1, [8192]),
    ("llama bs8 ctx1024", 32, 8, 8, [1024] * 8),
    ("llama bs64 ctx1024", 32, 8, 64, [1024] * 64),
    ("llama bs64 ctx4096", 32, 8, 64, [4096] * 64),
    ("qwen bs256 ctx600", 16, 8, 256, [600] * 256),
    ("qwen bs256 ctx100-2048", 16, 8, 256, None),
]


# FP8 block shapes (block_n, num_warps, num_stages): tensor-core ones, and narrow KV blocks for the CUDA-core variant,
# whose broadcast products hold BLOCK_H x HEAD_DIM x BLOCK_N values per block in registers.
FP8_MMA_SHAPES = ((64, 4, 2), (64, 4, 3), (128, 4, 3), (128, 8, 3), (256, 8, 3), (256, 4, 4))
FP8_CORE_SHAPES = ((16, 4, 2), (32, 4, 3), (32, 8, 3), (64, 8, 3))
FLAGS = ("fp8_bits", "cuda_cores", "k_rows")


def configs(batch: int, kv_dtype: torch.dtype) -> list[DecodeConfig]:
    splits = (64, 128, 256) if batch <= 8 else (256,)
    if kv_dtype.itemsize == 2:
        return [DecodeConfig(bn, w, s, ms) for bn, w, s, ms in itertools.product((32, 64, 128), (4, 8), (2, 3), splits)]
    return fp8_configs(splits)


def fp8_configs(splits: tuple[int, ...]) -> list[DecodeConfig]:
    """Every FP8 variant (DecodeConfig's flags) at 256-token splits, 40 configs; the shorter splits of small batches
    on the plain kernel only (the variants target per-token work, which large batches expose)."""
    variants = [dict(fp8_bits=b, k_rows=r) for b in (False, True) for r in (False, True)]
    rows = [DecodeConfig(*shape, 256, cuda_cores=False, **v) for shape in FP8_MMA_SHAPES for v in variants]
    rows += [DecodeConfig(*shape, 256, cuda_cores=True, **v) for shape in FP8_CORE_SHAPES for v in variants]
    rows += [DecodeConfig(*shape, ms) for shape in FP8_MMA_SHAPES for ms in splits if ms != 256]
    return rows


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
    splits = decode_num_splits(batch, hkv, q.device)
    po, pl = decode_workspace(batch, hq, 128, splits, q.device)
    ref = torch.empty_like(q)
    decode_attention(q, k_cache, v_cache, table, seq_lens, ref, 0.088, 16, splits, po, pl, DecodeConfig())
    nbytes = sum(lens) * hkv * 128 * 2 * kv_dtype.itemsize + 2 * q.numel() * 2
    rows = []
    for cfg in configs(batch, kv_dtype):
        out = torch.full_like(q, float("nan"))
        fn = lambda: decode_attention(q, k_cache, v_cache, table, seq_lens, out, 0.088, 16, splits, po, pl, cfg)  # noqa: E731
        try:
            fn()
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            us = 1e3 * triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")
        except Exception as e:  # a block shape the compiler rejects is a result
            rows.append(dict(case=name, config=cfg.__repr__(), error=repr(e)[:200]))
            continue
        rows.append(dict(case=name, batch=batch, block_n=cfg.block_n, num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages, min_split_len=cfg.min_split_len,
                         **{flag: getattr(cfg, flag) for flag in FLAGS}, max_splits=splits, us=us,
                         gbps=nbytes / us / 1e3, frac_copy=nbytes / us / 1e3 / ceiling_gbps, rel_err=err))
    return rows


def describe(row: dict) -> str:
    """A timing row in one line: time, share of the copy ceiling, block shape and the FP8 flags that are on."""
    flags = "".join(f" {flag}" for flag in FLAGS if row[flag])
    return (f"{row['us']:8.1f} us ({100 * row['frac_copy']:5.1f}%) bn={row['block_n']} w={row['num_warps']} "
            f"s={row['num_stages']} split={row['min_split_len']}{flags}")


def report(name: str, case_rows: list[dict], seconds: float) -> None:
    """The case's default and best configs; with FP8 variants, the best of each flag combination below."""
    ok = [r for r in case_rows if "us" in r and r["rel_err"] < 2e-2]
    shape = lambda r: (r["block_n"], r["num_warps"], r["num_stages"], r["min_split_len"])  # noqa: E731
    default = next(r for r in ok if shape(r) == (64, 4, 2, 256) and not any(r[flag] for flag in FLAGS))
    bad = [r for r in case_rows if "error" in r or r.get("rel_err", 0) >= 2e-2]
    print(f"{name:24s} default {describe(default)}\n{'':24s} best    {describe(min(ok, key=lambda r: r['us']))}"
          f"  failed {len(bad)}  [{seconds:.0f} s]")
    combos = sorted({tuple(r[flag] for flag in FLAGS) for r in ok})
    for combo in combos if len(combos) > 1 else ():
        best = min((r for r in ok if tuple(r[flag] for flag in FLAGS) == combo), key=lambda r: r["us"])
        print(f"{'':24s}   {describe(best)}")


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
        report(case[0], case_rows, time.perf_counter() - t)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                   "kv_dtype": args.kv_dtype, "copy_gbps": ceiling, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
