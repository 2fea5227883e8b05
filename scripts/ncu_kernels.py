"""Runs each kernel under study a few times so Nsight Compute can profile it (a machine whose runtime lets ncu read
the hardware counters: KINDS.md in the device library). Not a timing benchmark: ncu replays each launch.

  ncu --clock-control none --set full -k regex:'_decode_split_kernel|fp8_rows_kernel' -o $OUT/k \
      python3 scripts/ncu_kernels.py [decode] [rows]

decode: the split-KV decode kernel at llama-3.1-8b heads, batch 64 x 4k, bf16 then FP8 pages (the engine's config).
rows: the FP8 rows kernel at 1 row for the o and down projections, quantizing in the kernel, unsplit and split 4.
"""

from __future__ import annotations

import sys

import torch

from pdserve.bench.kernels import PagedPool
from pdserve.kernels.attention import decode_attention, decode_num_splits, decode_workspace
from pdserve.quantization.fp8 import Fp8RowsConfig, fp8_rows_linear, quantize_rows


def decode() -> None:
    batch, ctx, hq, hkv = 64, 4096, 32, 8
    pool = PagedPool(batch * ctx + 64, hkv, 128, 16)
    table = pool.page_table(batch, ctx)
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, hq, 128, device="cuda", dtype=torch.bfloat16)
    splits = decode_num_splits(batch, hkv, q.device)
    workspace = decode_workspace(batch, hq, hkv, 128, splits, q.device)
    out = torch.empty_like(q)
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        k, v = pool.k.to(kv_dtype), pool.v.to(kv_dtype)
        for _ in range(2):
            decode_attention(q, k, v, table, seq_lens, out, 0.088, 16, splits, workspace)
        del k, v
    torch.cuda.synchronize()


def rows() -> None:
    x = torch.randn(1, 14336, device="cuda", dtype=torch.bfloat16)
    for n, k in ((4096, 4096), (4096, 14336)):
        weight, scale = quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
        for split in (1, 4):
            cfg = Fp8RowsConfig(64, 256, 4, 4 if split > 1 else 3, True, split)
            for _ in range(2):
                fp8_rows_linear(x[:, :k], weight, scale, None, None, cfg)
    torch.cuda.synchronize()


if __name__ == "__main__":
    for what in sys.argv[1:] or ["decode", "rows"]:
        {"decode": decode, "rows": rows}[what]()
