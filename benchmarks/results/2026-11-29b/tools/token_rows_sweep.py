"""Fourteenth session, call 1: the FP8-page decode kernel with the tokens as the MMAs' rows (`DecodeConfig.token_rows`,
warpgroup MMAs, words converted by inline PTX) against the engine's head-rows config, on the engine's cases, with
shuffled pages of 16 (decode_sweep's harness: CUDA graphs, median of 40 repetitions, output checked against the
engine config's). python benchmarks/results/2026-11-29b/tools/token_rows_sweep.py OUT.json
"""

import json
import sys
import time

import torch

from pdserve.bench.decode_sweep import CASES, time_config
from pdserve.bench.kernels import PagedPool
from pdserve.bench.roofline import Ceilings
from pdserve.kernels.attention import DECODE_MAX_SPLITS, DecodeConfig, decode_attention, decode_config, decode_num_splits

SHAPES = [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3), (256, 8, 2), (64, 2, 3)]


def main(out_path: str) -> None:
    ceiling = Ceilings.measure().hbm_gbps
    rows = []
    for name, hq, hkv, batch, lens in CASES:
        if lens is None:
            lens = torch.randint(100, 2049, (batch,), generator=torch.Generator().manual_seed(0)).tolist()
        pool = PagedPool(batch * (max(lens) + 16) + 64, hkv, 128, 16)
        k, v = pool.k.to(torch.float8_e4m3fn), pool.v.to(torch.float8_e4m3fn)
        del pool.k, pool.v
        table = pool.page_table(batch, max(lens))
        seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, hq, 128, device="cuda", dtype=torch.bfloat16)
        bound = decode_num_splits(batch, hkv, q.device)
        engine = decode_config(batch, fp8_cache=True)
        ref = torch.empty_like(q)
        decode_attention(q, k, v, table, seq_lens, ref, 0.088, 16, bound, config=engine)
        nbytes = sum(lens) * hkv * 128 * 2 + 2 * q.numel() * 2
        configs = [(engine, bound)]
        for bn, w, s in SHAPES:
            cfg = DecodeConfig(bn, w, s, engine.min_split_len, token_rows=True)
            configs += [(cfg, b) for b in (bound, 2 * bound) if b <= DECODE_MAX_SPLITS]
        t = time.perf_counter()
        for cfg, splits in configs:
            row = time_config(name, batch, cfg, splits, q, k, v, table, seq_lens, ref, nbytes, ceiling)
            row["token_rows"] = cfg.token_rows
            rows.append(row)
            print(f"{name:24s} token_rows={int(cfg.token_rows)} bn={cfg.block_n:3d} w={cfg.num_warps} "
                  f"s={cfg.num_stages} splits={splits:2d} "
                  + (f"{row['us']:8.1f} us {100 * row['frac_copy']:5.1f}% err {row['rel_err']:.1e}" if "us" in row
                     else row["error"][:120]), flush=True)
        print(f"[{name}: {time.perf_counter() - t:.0f} s]", flush=True)
        del k, v, pool
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "copy_gbps": ceiling,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
