"""Few-row linear layers on one CUDA GPU: cuBLAS against the skinny Triton kernel's block shapes, on the weight
shapes of qwen3-0.6b and llama-3.1-8b, timed inside CUDA graphs (as the decode step runs them).

python -m pdserve.bench.skinny_sweep --out FILE.json [--weights fp8 --shapes llama]
With `--weights fp8` the weights are E4M3 with per-row scales and the baseline is quantize + `torch._scaled_mm`
(`pdserve.quantization.fp8.quantized_linear`) against the FP8 rows kernel, with the rows quantized in the kernel
or by one launch before it, and K split across 1, 2 or 4 programs. Every call reads its weight from memory, as the
decode step does (`pdserve.kernels.skinny.cold_weights`): a weight that fits L2 is cycled through copies of it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F
import triton.testing

from pdserve.bench.cli import bench_parser
from pdserve.bench.roofline import Ceilings
from pdserve.kernels.skinny import CANDIDATES, SkinnyConfig, cold_weights, skinny_linear
from pdserve.quantization.fp8 import (
    FP8_CANDIDATES,
    FP8_IN_KERNEL_ROWS,
    Fp8RowsConfig,
    fp8_candidates,
    fp8_rows_linear,
    quantize_rows,
    quantized_linear,
)

SHAPES = {  # name: (out features N, in features K)
    "llama qkv": (6144, 4096), "llama o": (4096, 4096), "llama gate_up": (28672, 4096), "llama down": (4096, 14336),
    "llama lm_head": (128256, 4096), "qwen qkv": (4096, 1024), "qwen o": (1024, 2048), "qwen gate_up": (6144, 1024),
    "qwen down": (1024, 3072), "qwen lm_head": (151936, 1024),
}
SWEEP = [SkinnyConfig(bn, bk, 4, s) for bn, bk, s in itertools.product((16, 32, 64), (128, 256, 512), (3, 4))
         if bn * bk <= 16384]
FP8_SWEEP = [Fp8RowsConfig(bn, bk, 8 if bn == 128 else 4, s, q, split)
             for bn, bk, s, q, split in itertools.product((32, 64, 128), (128, 256, 512), (3, 4), (True, False), (1, 2, 4))
             if split == 1 or (bk, s) == (256, 4)]
FP8_BATCH_SWEEP = [Fp8RowsConfig(bn, bk, w, s, False, split)  # more rows than the kernel quantizes itself
                   for bn, bk, w, s, split in itertools.product((64, 128), (128, 256), (4, 8), (2, 3, 4), (1, 2, 4))]


def operands(n: int, k: int, m: int, weights: str):
    """(weight, baseline(), candidate(cfg), the float32 reference product, the configs to sweep) for m random rows.
    Each call reads its weight from memory, as the decode step does (`cold_weights`)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    if weights == "bf16":
        cold = cold_weights(w)
        return (w, lambda: F.linear(x, cold()), lambda cfg: skinny_linear(x, cold(), None, cfg),
                F.linear(x.float(), w.float()), SWEEP)
    w_q, scale = quantize_rows(w)
    cold = cold_weights(w_q)
    return (w_q, lambda: quantized_linear(x, cold(), scale, None, None),
            lambda cfg: fp8_rows_linear(x, cold(), scale, None, None, cfg),
            quantized_linear(x.float(), w_q, scale, None, None),
            fp8_candidates(m, FP8_SWEEP if m <= FP8_IN_KERNEL_ROWS else FP8_BATCH_SWEEP))


def config_fields(cfg) -> list:
    return [getattr(cfg, field) for field in cfg.__slots__]


def graph_us(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__)
    parser.add_argument("--out", required=True, help="the JSON file of every configuration's timing")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="activation rows (batch) measured")
    parser.add_argument("--weights", choices=["bf16", "fp8"], default="bf16", help="the weights' dtype")
    parser.add_argument("--shapes", nargs="*", help="only the shapes whose name contains one of these")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    ceiling = Ceilings.measure().hbm_gbps
    rows = []
    shapes = {name: nk for name, nk in SHAPES.items() if not args.shapes or any(p in name for p in args.shapes)}
    for (name, (n, k)), m in itertools.product(shapes.items(), args.rows):
        w, baseline, candidate, ref, sweep = operands(n, k, m, args.weights)
        nbytes = w.numel() * w.element_size()
        cublas = graph_us(baseline)
        best = None
        for cfg in sweep:
            try:
                out = candidate(cfg)
            except Exception as e:  # a block shape whose row tile does not fit in shared memory
                rows.append(dict(shape=name, rows=m, config=config_fields(cfg), error=repr(e)[:200]))
                continue
            err = ((out.float() - ref).norm() / ref.norm()).item()
            us = graph_us(lambda c=cfg: candidate(c))
            row = dict(shape=name, n=n, k=k, rows=m, config=config_fields(cfg),
                       candidate=cfg in (CANDIDATES if args.weights == "bf16" else FP8_CANDIDATES), us=us,
                       rel_err=err, cublas_us=cublas,
                       frac_copy=nbytes / us / 1e3 / ceiling, cublas_frac_copy=nbytes / cublas / 1e3 / ceiling)
            rows.append(row)
            if err < 1e-2 and (best is None or us < best["us"]):
                best = row
        cand = min((r for r in rows if r["shape"] == name and r["rows"] == m and r.get("candidate")),
                   key=lambda r: r["us"], default={"us": float("nan"), "config": None})
        print(f"{name:14s} M={m}  baseline {cublas:7.1f} us ({100 * nbytes / cublas / 1e3 / ceiling:4.1f}%)  "
              f"best {best['us']:7.1f} us ({100 * best['frac_copy']:4.1f}%) {best['config']}  "
              f"best candidate {cand['us']:7.1f} us {cand['config']}")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "copy_gbps": ceiling,
                   "weights": args.weights, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
