"""The whole decode kernel over FP8 pages with V as words (today) against V as FP8 tiles handed to the dot, after
the PV probe put the second at 79.5% and the first at 61% of the copy ceiling for V alone (H200, session 13).

python benchmarks/results/2026-11-29/tools/v_path_full.py   (after `git apply v_words_flag.patch`: the flag is not in the
product, the gain was 1% at 4k and 5% at 16k, and the words won on the H100)
"""

import torch

from pdserve.bench.decode_sweep import time_config
from pdserve.bench.kernels import PagedPool
from pdserve.bench.roofline import Ceilings
from pdserve.kernels.attention import DecodeConfig, decode_attention, decode_num_splits


def main():
    ceiling = Ceilings.measure().hbm_gbps
    for name, batch, ctx in (("bs64 ctx4096", 64, 4096), ("bs32 ctx16384", 32, 16384)):
        pool = PagedPool(batch * (ctx + 16) + 64, 8, 128, 16)
        k, v = pool.k.to(torch.float8_e4m3fn), pool.v.to(torch.float8_e4m3fn)
        del pool.k, pool.v
        table = pool.page_table(batch, ctx)
        seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
        bound = decode_num_splits(batch, 8, q.device)
        ref = torch.empty_like(q)
        decode_attention(q, k, v, table, seq_lens, ref, 0.088, 16, bound, config=DecodeConfig(64, 4, 3, 256))
        nbytes = batch * ctx * 8 * 128 * 2 + 2 * q.numel() * 2
        for bn, w, s in ((64, 4, 3), (64, 4, 2), (64, 4, 4), (128, 4, 3), (64, 8, 3), (128, 8, 3), (32, 4, 3)):
            for words in (True, False):
                cfg = DecodeConfig(bn, w, s, 256, v_words=words)
                for splits in (bound, 2 * bound):
                    row = time_config(name, batch, cfg, splits, q, k, v, table, seq_lens, ref, nbytes, ceiling)
                    print(f"{name} bn={bn:3d} w={w} s={s} words={int(words)} splits={splits} "
                          + (f"{row['us']:7.1f} us {100 * row['frac_copy']:5.1f}% err {row['rel_err']:.1e}"
                             if "us" in row else row["error"][:100]), flush=True)
        del pool, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
