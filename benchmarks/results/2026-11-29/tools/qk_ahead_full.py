"""For the next session (prepared in session 13, 2026-11-29, not yet run on a GPU): the whole decode kernel with the
next block's scores issued before this block's softmax and PV (`DecodeConfig.qk_ahead`: two independent chains an
iteration, for the warps' schedulers to interleave), against today's loop, FP8 and bf16 pages, batch 64 x 4k and
32 x 16k, llama-3.1-8b heads, shuffled pages of 16. The probes of this session put each half alone at 95% (QK) and
61-80% (PV) of the copy ceiling and the whole kernel at 63%: the chain between them is the suspect.

git apply benchmarks/results/2026-11-29/tools/qk_ahead.patch    (the variant and its interpreter test)
python benchmarks/results/2026-11-29/tools/qk_ahead_full.py
"""

import torch

from pdserve.bench.decode_sweep import time_config
from pdserve.bench.kernels import PagedPool
from pdserve.bench.roofline import Ceilings
from pdserve.kernels.attention import DecodeConfig, decode_attention, decode_num_splits

SHAPES = {torch.float8_e4m3fn: ((64, 4, 3), (64, 4, 2), (128, 4, 3), (64, 8, 3)),
          torch.bfloat16: ((128, 4, 2), (64, 4, 2), (64, 4, 3))}


def main():
    ceiling = Ceilings.measure().hbm_gbps
    for name, batch, ctx in (("bs64 ctx4096", 64, 4096), ("bs32 ctx16384", 32, 16384)):
        pool = PagedPool(batch * (ctx + 16) + 64, 8, 128, 16)
        table = pool.page_table(batch, ctx)
        seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
        bound = decode_num_splits(batch, 8, q.device)
        for kv_dtype, shapes in SHAPES.items():
            k, v = pool.k.to(kv_dtype), pool.v.to(kv_dtype)
            ref = torch.empty_like(q)
            decode_attention(q, k, v, table, seq_lens, ref, 0.088, 16, bound, config=DecodeConfig(64, 4, 3, 256))
            nbytes = batch * ctx * 8 * 128 * 2 * kv_dtype.itemsize + 2 * q.numel() * 2
            for bn, w, s in shapes:
                for ahead in (False, True):
                    row = time_config(name, batch, DecodeConfig(bn, w, s, 256, qk_ahead=ahead), bound, q, k, v, table,
                                      seq_lens, ref, nbytes, ceiling)
                    print(f"{name} {str(kv_dtype):20s} bn={bn:3d} w={w} s={s} qk_ahead={int(ahead)} "
                          + (f"{row['us']:7.1f} us {100 * row['frac_copy']:5.1f}% err {row['rel_err']:.1e}"
                             if "us" in row else row["error"][:100]), flush=True)
            del k, v
        del pool
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
