"""Experiment of call 2 (kept with its results; needs that tree: PDL and a heads-first grid switch): decode kernel grid order and PDL, bs64 x 4k llama heads, bf16 and fp8 pages."""
import os, json, sys
import torch, triton.testing
from pdserve.bench.kernels import PagedPool
from pdserve.kernels import attention as A
from pdserve.kernels import pdl
res = []
for kv in (torch.float8_e4m3fn, torch.bfloat16):
    for batch, ctx in ((64, 4096), (1, 1024)):
        pool = PagedPool(batch * ctx + 64, 8, 128, 16)
        k, v = pool.k.to(kv), pool.v.to(kv)
        table = pool.page_table(batch, ctx)
        sl = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
        splits = A.decode_num_splits(batch, 8, q.device)
        po, pl = A.decode_workspace(batch, 32, 128, splits, q.device)
        outs = {}
        for rnd in range(2):
            for hf in ("0", "1"):
                for p in ("0", "1"):
                    os.environ["PDSERVE_DECODE_HEADS_FIRST"] = hf
                    os.environ["PDSERVE_PDL"] = p
                    pdl._supported.cache_clear()
                    out = torch.empty_like(q)
                    fn = lambda: A.decode_attention(q, k, v, table, sl, out, 0.088, 16, splits, po, pl)
                    fn(); torch.cuda.synchronize()
                    us = 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
                    outs[hf + p] = out.clone()
                    r = dict(kv=str(kv), batch=batch, ctx=ctx, heads_first=hf, pdl=p, round=rnd, us=round(us, 2))
                    print(r, flush=True); res.append(r)
        base = outs["00"]
        print("max diff vs 00:", {key: (o.float() - base.float()).abs().max().item() for key, o in outs.items()})
        del pool, k, v
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "decode_ab.json"), "w"), indent=1)
