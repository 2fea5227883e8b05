"""Does FlashAttention-4 run on this H200 image, and how fast against SDPA/cuDNN and pdserve's Triton kernels?

Needs flash-attn-4 (4.0.0b36) with nvidia-cutlass-dsl 4.8.1 and its cu13 libs, quack-kernels, apache-tvm-ffi and
torch-c-dlpack-ext importable. The cu13 libs wheel is 92 MB (63.5 MB as tar.xz), over one device call's 64 MiB
carry: it travelled in two halves over two calls on one warm machine (the first copies its half to /tmp).
Writes $OUT/fa4_probe.json; results of 2026-11-23 in benchmarks/results/2026-11-23/issue15/.
"""

import json, os, sys, time, traceback
import torch, torch.nn.functional as F
import triton.testing
from pdserve.kernels.attention import extend_attention, decode_attention, decode_num_splits, decode_workspace

BF = torch.bfloat16
res = {}


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def first(r):
    return r[0] if isinstance(r, tuple) else r


t = time.time()
try:
    from flash_attn.cute import flash_attn_varlen_func as fa
except Exception:
    traceback.print_exc()
    print("FA4 IMPORT FAILED")
    sys.exit(1)
print(f"import {time.time() - t:.1f} s")


def timed_first(name, fn):
    t = time.time()
    out = first(fn())
    torch.cuda.synchronize()
    print(f"{name}: first call {time.time() - t:.1f} s")
    return out


def attn_tflops(pairs, H, D):
    return 4 * pairs * H * D


H, HKV, D = 32, 8, 128
i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")


def case(name, fn):
    try:
        fn()
    except Exception as e:
        traceback.print_exc()
        res[name] = {"error": repr(e)[:400]}
        print(f"{name}: FAILED {e!r}"[:300])


# 1 fresh prompts: one 8k, 16 x 512
def fresh(lens):
    T = sum(lens)
    q = torch.randn(T, H, D, device="cuda", dtype=BF)
    k = torch.randn(T, HKV, D, device="cuda", dtype=BF)
    v = torch.randn_like(k)
    cu = i32([0] + list(torch.tensor(lens).cumsum(0).tolist()))
    f = lambda: fa(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens), causal=True
    )
    o = timed_first(f"fresh {len(lens)}x{lens[0]}", f)
    def sdpa_per_prompt():
        return [
            F.scaled_dot_product_attention(
                *(t[s : s + n].transpose(0, 1)[None] for t in (q, k, v)), is_causal=True, enable_gqa=True
            )[0].transpose(0, 1)
            for s, n in zip(cu.tolist()[:-1], lens)
        ]

    ref = torch.cat(sdpa_per_prompt())
    flops = attn_tflops(sum(n * (n + 1) // 2 for n in lens), H, D)
    record(f"fresh {len(lens)}x{lens[0]}", rel(o, ref), flops, bench(f), "sdpa", bench(sdpa_per_prompt))


def record(name, err, flops, ms_fa, other, ms_other):
    """FA4 against another kernel on the same work: error, times and TFLOP/s of both."""
    res[name] = r = {"rel_err": err, "fa4_ms": ms_fa, f"{other}_ms": ms_other, "fa4_tflops": flops / ms_fa / 1e9,
                     f"{other}_tflops": flops / ms_other / 1e9}
    print(name, r)


case("fresh 1x8192", lambda: fresh([8192]))
case("fresh 16x512", lambda: fresh([512] * 16))


# 2 prefix extend through a page table (page 16 = pdserve's default; 128 = FA4's TMA tile)
def extend(prefix, new, page):
    total = prefix + new
    pages = (total + page - 1) // page
    kc = torch.randn(pages + 8, page, HKV, D, device="cuda", dtype=BF)
    vc = torch.randn_like(kc)
    table = (torch.randperm(pages + 7, device="cuda")[:pages] + 1).to(torch.int32)[None]
    q = torch.randn(new, H, D, device="cuda", dtype=BF)
    f = lambda: fa(
        q, kc, vc, cu_seqlens_q=i32([0, new]), max_seqlen_q=new, seqused_k=i32([total]), page_table=table, causal=True
    )
    o = timed_first(f"extend {prefix}+{new} p{page}", f)
    out = torch.empty_like(q)
    kf, vf = kc.view(-1, HKV, D), vc.view(-1, HKV, D)
    tr = lambda: extend_attention(q, kf, vf, table, i32([prefix]), i32([new]), i32([0]), new, out, D**-0.5, page)
    tr()
    flops = attn_tflops(new * prefix + new * (new + 1) // 2, H, D)
    record(f"extend {prefix}+{new} p{page}", rel(o, out), flops, bench(f), "triton", bench(tr))


case("extend p16", lambda: extend(6144, 2048, 16))
case("extend p128", lambda: extend(6144, 2048, 128))


# 3 paged decode (FA4 has no split-KV on SM90)
def decode(bs, ctx, hq, page=16):
    pages = (ctx + page - 1) // page
    kc = torch.randn(bs * pages + 8, page, HKV, D, device="cuda", dtype=BF)
    vc = torch.randn_like(kc)
    table = (torch.randperm(bs * pages + 7, device="cuda")[: bs * pages] + 1).to(torch.int32).view(bs, pages)
    q = torch.randn(bs, hq, D, device="cuda", dtype=BF)
    seq = i32([ctx] * bs)
    f = lambda: fa(
        q,
        kc,
        vc,
        cu_seqlens_q=torch.arange(bs + 1, dtype=torch.int32, device="cuda"),
        max_seqlen_q=1,
        seqused_k=seq,
        page_table=table,
        causal=True,
    )
    o = timed_first(f"decode bs{bs} ctx{ctx}", f)
    out = torch.empty_like(q)
    splits = decode_num_splits(bs, HKV, q.device)
    workspace = decode_workspace(bs, hq, HKV, D, splits, q.device)
    tr = lambda: decode_attention(
        q, kc.view(-1, HKV, D), vc.view(-1, HKV, D), table, seq, out, D**-0.5, page, splits, workspace
    )
    tr()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        first(f())
    ms_fa, ms_tr = (
        triton.testing.do_bench_cudagraph(f, rep=40, return_mode="median"),
        triton.testing.do_bench_cudagraph(tr, rep=40, return_mode="median"),
    )
    nbytes = bs * ctx * HKV * D * 4
    r = dict(
        rel_err_vs_triton=rel(o, out),
        graph_capture="ok",
        fa4_us=1e3 * ms_fa,
        triton_us=1e3 * ms_tr,
        fa4_gbps=nbytes / ms_fa / 1e6,
        triton_gbps=nbytes / ms_tr / 1e6,
    )
    res[f"decode bs{bs} ctx{ctx} hq{hq}"] = r
    print(f"decode bs{bs} ctx{ctx} hq{hq}", r)


case("decode bs1", lambda: decode(1, 1024, 32))
case("decode bs64", lambda: decode(64, 1024, 32))
case("decode bs256", lambda: decode(256, 600, 16))
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "fa4_probe.json"), "w"), indent=1)
