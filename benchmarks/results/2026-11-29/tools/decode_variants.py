"""The paged decode kernel's variants at batch 64 x 4k and at 16k, FP8 and bf16 pages, against the copy ceiling
(session 13, 2026-11-29): V's bytes converted by inline PTX (`DecodeConfig.v_asm`), the kv heads of a request
next to each other in the grid (`heads_first`), block shapes, split bounds 1x/2x/4x the engine's; then 32 layers'
caches in one tensor as the engine holds them, each layer read once per graph replay against one layer read 32
times, pages contiguous per request or shuffled. Prints one line per timing, writes JSON.

python benchmarks/results/2026-11-29/tools/decode_variants.py OUT.json [random_fp8]
The variants are not in the product (none won enough to keep): apply `decode_variants.patch` (to the tree of
51246ff) first.
"""

import dataclasses
import json
import sys
import time

import torch
import triton.testing

from pdserve.bench.decode_sweep import time_config
from pdserve.bench.kernels import PagedPool
from pdserve.bench.roofline import Ceilings
from pdserve.kernels.attention import (DecodeConfig, decode_attention, decode_config, decode_num_splits,
                                      decode_workspace)

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
CASES = [("bs64 ctx4096", 64, 4096), ("bs32 ctx16384", 32, 16384), ("bs64 ctx16384", 64, 16384)]


def fp8_configs():
    out = [DecodeConfig(64, 4, 3, 256)]  # the engine's today
    for bn, w, s in ((64, 4, 3), (64, 4, 2), (64, 4, 4), (128, 4, 3), (128, 8, 3), (64, 8, 3), (128, 8, 2), (32, 4, 3)):
        out.append(DecodeConfig(bn, w, s, 256, v_asm=True))
    out.append(DecodeConfig(64, 4, 3, 256, v_asm=True, heads_first=True))
    return out


def bf16_configs():
    return [DecodeConfig(128, 4, 2, 256), DecodeConfig(64, 4, 2, 256), DecodeConfig(128, 8, 2, 256),
            DecodeConfig(64, 4, 3, 256)]


def layered(name, batch, ctx, kv_dtype, configs, contiguous, ceiling):
    """32 layers' caches in one tensor, as the engine's pool holds them: one CUDA graph of 32 decode calls, each on
    the next layer (a step reads every layer once), against 32 calls on one layer."""
    pages = ctx // 16
    slots = (batch * pages + 1) * 16
    cache = torch.empty(2, 32, slots, 8, 128, dtype=kv_dtype, device="cuda")
    for i in range(2):
        for start in range(0, slots, 1 << 18):
            cache[i, 0, start:start + (1 << 18)] = torch.randn(min(1 << 18, slots - start), 8, 128, device="cuda")
        cache[i, 1:] = cache[i, 0]
    order = (torch.arange(batch * pages, device="cuda") if contiguous else torch.randperm(batch * pages, device="cuda"))
    table = (order.to(torch.int32) + 1).view(batch, pages).contiguous()
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, 32, 128, device="cuda", dtype=BF16)
    bound = decode_num_splits(batch, 8, q.device)
    nbytes = batch * ctx * 8 * 128 * 2 * kv_dtype.itemsize
    rows = []
    for cfg in configs:
        workspace = decode_workspace(batch, 32, 8, 128, bound, q.device)
        out = torch.empty_like(q)
        for spread in (False, True):
            def fn():
                for layer in range(32):
                    at = layer if spread else 0
                    decode_attention(q, cache[0, at], cache[1, at], table, seq_lens, out, 0.088, 16, bound, workspace,
                                     cfg)
            us = 1e3 * triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") / 32
            row = dict(case=name, kv=str(kv_dtype), layered=True, contiguous=contiguous, spread=spread,
                       config=repr(cfg), us=us, frac_copy=nbytes / us / 1e3 / ceiling)
            rows.append(row)
            print(f"LAYERS {name:14s} {str(kv_dtype):20s} contiguous={int(contiguous)} 32 layers={int(spread)} "
                  f"{cfg} {us:8.1f} us {100 * row['frac_copy']:5.1f}%", flush=True)
    del cache
    torch.cuda.empty_cache()
    return rows


def main():
    ceiling = Ceilings.measure().hbm_gbps
    rows = []
    if sys.argv[2:] == ["random_fp8"]:  # call 2 stopped on an illegal address here: which config, which launch
        base = decode_config(64, True)
        for cfg in (base, dataclasses.replace(base, v_asm=True)):
            layered("bs64 ctx16384", 64, 16384, FP8, [cfg], False, ceiling)
        return
    for name, batch, ctx, kv_dtype in (("bs32 ctx16384", 32, 16384, BF16), ("bs64 ctx16384", 64, 16384, FP8),
                                       ("bs64 ctx4096", 64, 4096, FP8), ("bs64 ctx4096", 64, 4096, BF16)):
        base = decode_config(batch, kv_dtype.itemsize == 1)
        configs = [base, dataclasses.replace(base, heads_first=True)]
        if kv_dtype == FP8:
            configs.append(dataclasses.replace(base, v_asm=True))
        for contiguous in (True, False):
            rows += layered(name, batch, ctx, kv_dtype, configs, contiguous, ceiling)
    for name, batch, ctx in CASES:
        pool = PagedPool(batch * (ctx + 16) + 64, 8, 128, 16)
        table = pool.page_table(batch, ctx)
        seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, 32, 128, device="cuda", dtype=BF16)
        for kv_dtype, configs in ((FP8, fp8_configs()), (BF16, bf16_configs())):
            if kv_dtype == BF16 and name == "bs64 ctx16384":
                continue
            k_cache, v_cache = pool.k.to(kv_dtype), pool.v.to(kv_dtype)
            ref = torch.empty_like(q)
            bound = decode_num_splits(batch, 8, q.device)
            decode_attention(q, k_cache, v_cache, table, seq_lens, ref, 0.088, 16, bound, config=DecodeConfig())
            nbytes = batch * ctx * 8 * 128 * 2 * kv_dtype.itemsize + 2 * q.numel() * 2
            for cfg in configs:
                for splits in (bound, 2 * bound, 4 * bound):
                    if splits > 64:
                        continue
                    t = time.perf_counter()
                    row = time_config(name, batch, cfg, splits, q, k_cache, v_cache, table, seq_lens, ref, nbytes,
                                      ceiling)
                    row.update(kv=str(kv_dtype), v_asm=cfg.v_asm, heads_first=cfg.heads_first)
                    rows.append(row)
                    print(f"{name:14s} {str(kv_dtype):20s} bn={cfg.block_n:3d} w={cfg.num_warps} s={cfg.num_stages} "
                          f"asm={int(cfg.v_asm)} hf={int(cfg.heads_first)} splits={splits:2d} "
                          + (f"{row['us']:8.1f} us {100 * row['frac_copy']:5.1f}% err {row['rel_err']:.1e}"
                             if "us" in row else row["error"][:120]) + f" [{time.perf_counter() - t:.1f} s]",
                          flush=True)
            del k_cache, v_cache
        del pool
        torch.cuda.empty_cache()
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "copy_gbps": ceiling,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
