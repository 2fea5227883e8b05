"""The paged decode kernel's variants at batch 64 x 4k and at 16k, FP8 and bf16 pages, against the copy ceiling
(session 13, 2026-11-29): V's (and K's) words loaded a block ahead into registers (`DecodeConfig.v_ahead`,
`k_ahead`), block shapes, split bounds 1x/2x/4x the engine's. Prints one line per timing, writes JSON.

python benchmarks/results/2026-11-29/tools/decode_variants.py OUT.json
"""

import json
import sys
import time

import torch

from pdserve.bench.decode_sweep import time_config
from pdserve.bench.kernels import PagedPool
from pdserve.bench.roofline import Ceilings
from pdserve.kernels.attention import DecodeConfig, decode_attention, decode_num_splits

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
CASES = [("bs64 ctx4096", 64, 4096), ("bs32 ctx16384", 32, 16384), ("bs64 ctx16384", 64, 16384)]


def fp8_configs():
    out = [DecodeConfig(64, 4, 3, 256)]  # the engine's today
    for bn, w, s in ((64, 4, 3), (64, 4, 2), (64, 4, 4), (128, 4, 3), (128, 8, 3), (64, 8, 3), (32, 4, 3),
                     (128, 8, 2)):
        out.append(DecodeConfig(bn, w, s, 256, v_ahead=True))
        out.append(DecodeConfig(bn, w, s, 256, v_ahead=True, k_ahead=True))
    return out


def bf16_configs():
    return [DecodeConfig(128, 4, 2, 256), DecodeConfig(64, 4, 2, 256), DecodeConfig(128, 8, 2, 256),
            DecodeConfig(64, 4, 3, 256)]


def main():
    ceiling = Ceilings.measure().hbm_gbps
    rows = []
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
                    row.update(kv=str(kv_dtype), v_ahead=cfg.v_ahead, k_ahead=cfg.k_ahead)
                    rows.append(row)
                    print(f"{name:14s} {str(kv_dtype):20s} bn={cfg.block_n:3d} w={cfg.num_warps} s={cfg.num_stages} "
                          f"va={int(cfg.v_ahead)} ka={int(cfg.k_ahead)} splits={splits:2d} "
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
