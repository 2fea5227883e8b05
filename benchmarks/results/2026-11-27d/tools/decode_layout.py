"""Experiment of call 4 (kept with its results): is the FP8 decode kernel held back by reading 128 B of every 1 KB token slot?
Same bytes, three layouts: 64 requests x 8 KV heads, 256 x 2 heads, 512 x 1 head (4 q heads per KV head)."""
import os, json
import torch, triton.testing
from pdserve.bench.kernels import PagedPool
from pdserve.kernels import attention as A
res = []
for kv in (torch.float8_e4m3fn, torch.bfloat16):
    for batch, hkv in ((64, 8), (256, 2), (512, 1), (64, 8)):
        ctx = 4096
        pool = PagedPool(batch * ctx + 64, hkv, 128, 16)
        k, v = pool.k.to(kv), pool.v.to(kv)
        del pool.k, pool.v
        table = pool.page_table(batch, ctx)
        sl = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, 4 * hkv, 128, device="cuda", dtype=torch.bfloat16)
        splits = A.decode_num_splits(batch, hkv, q.device)
        po, pl = A.decode_workspace(batch, 4 * hkv, 128, splits, q.device)
        out = torch.empty_like(q)
        fn = lambda: A.decode_attention(q, k, v, table, sl, out, 0.088, 16, splits, po, pl)
        fn(); torch.cuda.synchronize()
        us = 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        gbs = batch * ctx * hkv * 128 * 2 * kv.itemsize / us / 1e3
        r = dict(kv=str(kv), batch=batch, kv_heads=hkv, splits=splits, us=round(us, 2), gbps=round(gbs))
        print(r, flush=True); res.append(r)
        del k, v, pool
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "decode_layout.json"), "w"), indent=1)
