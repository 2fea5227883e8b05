"""Kernel micro-benchmarks on one CUDA GPU: paged decode / extend attention, KV store, fused ops (and the
layer's fused q/k norm + rotary + KV store against the separate kernels), sampling.

Extend attention side by side: the Triton extend kernel (each block configuration), SDPA (fresh prompts) and,
where flash_attn.cute is installed, FlashAttention-4 as the flash_attn backend calls it (`fa4` on the new tokens'
q/k/v for fresh prompts, `fa4_paged` through the page table for every case).

python -m pdserve.bench.kernels --out DIR [--quick]
Writes DIR/kernels.json (every measurement) and DIR/kernels.png; prints a table. Times are medians of
triton.testing.do_bench (extend, long kernels) or do_bench_cudagraph (everything else: the graphs the
engine replays). Ceilings: a device-to-device copy measured here (bytes read + written) and the bf16
matrix rate (an 8192^3 matmul measured here); the reference figures are 4,282 GB/s and 790 TFLOP/s (H200).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import triton
import triton.testing

from pdserve.attention.flash_attn_backend import PrefillPlan, fresh_attention, load_flash_attn, paged_attention
from pdserve.attention.selection import flash_attn_installed
from pdserve.bench.cli import bench_parser
from pdserve.bench.roofline import Ceilings
from pdserve.kernels import fused, ops, sampling
from pdserve.kernels.attention import (
    attention_flops,
    decode_attention,
    decode_num_splits,
    decode_workspace,
    extend_attention,
    store_kv,
)

MODELS = {"qwen3-0.6b": (16, 8, 128, 1024, 3072), "llama-8b": (32, 8, 128, 4096, 14336)}  # Hq, Hkv, D, hidden, inter
BF16 = torch.bfloat16
# extend kernel block configurations swept by bench_extend (the first of each list is extend_config's default)
EXTEND_CANDIDATES = {
    64: [dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3), dict(BLOCK_M=128, BLOCK_N=128, num_warps=8,
         num_stages=3), dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)],
    128: [dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3), dict(BLOCK_M=128, BLOCK_N=128, num_warps=8,
          num_stages=2), dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
          dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2), dict(BLOCK_M=64, BLOCK_N=64, num_warps=4,
          num_stages=3)],
}


def ms_graph(fn) -> float:
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def ms_eager(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def measure_ceilings() -> dict:
    ceilings = Ceilings.measure()
    return {"copy_gbps": ceilings.hbm_gbps, "matmul_tflops": ceilings.matmul_tflops}


class PagedPool:
    """Random bf16 K/V for num_tokens tokens in shuffled pages, and page tables for uniform batches."""

    def __init__(self, num_tokens: int, num_kv_heads: int, head_dim: int, page_size: int):
        self.page_size = page_size
        self.num_pages = num_tokens // page_size + 1
        slots = self.num_pages * page_size
        self.k = torch.randn(slots, num_kv_heads, head_dim, device="cuda", dtype=BF16)
        self.v = torch.randn_like(self.k)
        self.perm = torch.randperm(self.num_pages - 1, device="cuda").to(torch.int32) + 1

    def page_table(self, batch: int, seq_len: int) -> torch.Tensor:
        pages = triton.cdiv(seq_len, self.page_size)
        assert batch * pages <= self.num_pages - 1
        return self.perm[: batch * pages].view(batch, pages).contiguous()


def bench_decode(ceil: dict, quick: bool) -> list[dict]:
    rows = []
    max_tokens = 1 << 20
    for model, (hq, hkv, dim, _, _) in MODELS.items():
        pool = PagedPool(max_tokens, hkv, dim, 16)
        for ctx in (1024, 4096, 16384):
            for batch in (1, 8, 32, 64, 128, 256):
                if batch * ctx > max_tokens or (quick and batch not in (1, 64)):
                    continue
                q = torch.randn(batch, hq, dim, device="cuda", dtype=BF16)
                out = torch.empty_like(q)
                table = pool.page_table(batch, ctx)
                seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
                splits = decode_num_splits(batch, hkv, q.device)
                workspace = decode_workspace(batch, hq, hkv, dim, splits, q.device)
                ms = ms_graph(lambda: decode_attention(q, pool.k, pool.v, table, seq_lens, out, 0.088, 16, splits,
                                                       workspace))
                nbytes = batch * ctx * hkv * dim * 2 * 2 + 2 * q.numel() * 2
                gbps = nbytes / ms / 1e6
                rows.append(dict(kind="decode", model=model, batch=batch, ctx=ctx, splits=splits, us=ms * 1e3,
                                 gbps=gbps, frac_copy=gbps / ceil["copy_gbps"], frac_4282=gbps / 4282))
    # page-size sensitivity at one point
    for page_size in (1, 64):
        pool = PagedPool(64 * 4096, 8, 128, page_size)
        q = torch.randn(64, 32, 128, device="cuda", dtype=BF16)
        out, table = torch.empty_like(q), pool.page_table(64, 4096)
        seq_lens = torch.full((64,), 4096, device="cuda", dtype=torch.int32)
        splits = decode_num_splits(64, 8, q.device)
        ms = ms_graph(lambda: decode_attention(q, pool.k, pool.v, table, seq_lens, out, 0.088, page_size, splits))
        gbps = (64 * 4096 * 8 * 128 * 4 + 4 * q.numel()) / ms / 1e6
        rows.append(dict(kind="decode_page_size", model="llama-8b", page_size=page_size, batch=64, ctx=4096,
                         us=ms * 1e3, gbps=gbps, frac_copy=gbps / ceil["copy_gbps"]))
    return rows


def bench_extend(ceil: dict) -> list[dict]:
    rows = []
    fa4 = load_flash_attn() if flash_attn_installed() else None
    cases = [("8k", [(0, 8192)]), ("8k+8k prefix", [(8192, 8192)]), ("2k chunk after 6k", [(6144, 2048)]),
             ("16x512", [(0, 512)] * 16), ("4x1024", [(0, 1024)] * 4), ("2x2048", [(0, 2048)] * 2)]
    for model, (hq, hkv, dim, _, _) in MODELS.items():
        pool = PagedPool(1 << 15, hkv, dim, 16)
        for name, specs in cases:
            batch = len(specs)
            q_lens, kv_lens = [e for _, e in specs], [p + e for p, e in specs]
            total = sum(q_lens)
            q = torch.randn(total, hq, dim, device="cuda", dtype=BF16)
            k = torch.randn(total, hkv, dim, device="cuda", dtype=BF16)
            v = torch.randn_like(k)
            out = torch.empty_like(q)
            table = pool.page_table(batch, max(kv_lens))
            as_i32 = lambda xs: torch.tensor(xs, device="cuda", dtype=torch.int32)  # noqa: E731
            prefix, ext = as_i32([p for p, _ in specs]), as_i32(q_lens)
            starts = as_i32([sum(q_lens[:i]) for i in range(batch)])
            flops = attention_flops(q_lens, kv_lens, hq, dim)
            impls = {
                "triton_bm%d_bn%d_w%d_s%d" % tuple(c.values()): lambda c=c: extend_attention(
                    q, pool.k, pool.v, table, prefix, ext, starts, max(q_lens), out, 0.088, 16, config=c)
                for c in EXTEND_CANDIDATES[dim]
            }
            if not any(p for p, _ in specs):
                impls["sdpa_loop"] = lambda: [
                    torch.nn.functional.scaled_dot_product_attention(
                        q[s:s + n].transpose(0, 1)[None], k[s:s + n].transpose(0, 1)[None],
                        v[s:s + n].transpose(0, 1)[None], is_causal=True, enable_gqa=True)
                    for s, n in zip(range(0, total, q_lens[0]), q_lens)]
            if fa4 is not None:
                impls.update(flash_attn_impls(fa4, q, k, v, pool, table, q_lens, kv_lens))
            for impl, fn in impls.items():
                try:
                    fn()  # FlashAttention-4 compiles a variant on its first call
                    ms = ms_eager(fn)
                except Exception as e:  # an unsupported torch path is a result, not a crash
                    rows.append(dict(kind="extend", model=model, case=name, impl=impl, error=repr(e)[:300]))
                    continue
                tflops = flops / ms / 1e9
                rows.append(dict(kind="extend", model=model, case=name, impl=impl, us=ms * 1e3, tflops=tflops,
                                 frac_matmul=tflops / ceil["matmul_tflops"], frac_790=tflops / 790))
    return rows


def flash_attn_impls(fa4, q, k, v, pool: PagedPool, table, q_lens: list[int], kv_lens: list[int]) -> dict:
    as_i32 = lambda xs: torch.tensor(xs, device="cuda", dtype=torch.int32)  # noqa: E731
    cu_seqlens = as_i32([sum(q_lens[:i]) for i in range(len(q_lens) + 1)])
    plan = PrefillPlan(cu_seqlens, max(q_lens), True, as_i32(kv_lens), table)
    impls = {"fa4_paged": lambda: paged_attention(fa4, q, pool.k, pool.v, plan, pool.page_size, 0.088)}
    if q_lens == kv_lens:
        impls["fa4"] = lambda: fresh_attention(fa4, q, k, v, plan, 0.088)
    return impls


def bench_store(ceil: dict) -> list[dict]:
    rows = []
    k_cache = torch.randn(1 << 20, 8, 128, device="cuda", dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    for tokens in (1, 64, 256, 8192):
        k = torch.randn(tokens, 8, 128, device="cuda", dtype=BF16)
        v = torch.randn_like(k)
        loc = torch.randperm(1 << 20, device="cuda")[:tokens]
        nbytes = 4 * k.numel() * 2

        def index_copy():
            k_cache.index_copy_(0, loc, k)
            v_cache.index_copy_(0, loc, v)

        for impl, fn in (("triton", lambda: store_kv(k, v, k_cache, v_cache, loc)), ("index_copy", index_copy)):
            ms = ms_graph(fn)
            rows.append(dict(kind="store_kv", tokens=tokens, impl=impl, us=ms * 1e3, gbps=nbytes / ms / 1e6))
    return rows


def bench_fused(ceil: dict) -> list[dict]:
    rows = []
    for model, (hq, hkv, dim, hidden, inter) in MODELS.items():
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        cache = ops.build_cos_sin_cache(inv_freq, 32768).cuda()
        for tokens in (1, 256, 8192):
            x, res = (torch.randn(tokens, hidden, device="cuda", dtype=BF16) for _ in range(2))
            w = torch.randn(hidden, device="cuda", dtype=BF16)
            qkv = torch.randn(tokens, hq + 2 * hkv, dim, device="cuda", dtype=BF16)
            pos = torch.randint(0, 32768, (tokens,), device="cuda")
            gate_up = torch.randn(tokens, 2 * inter, device="cuda", dtype=BF16)
            cases = {
                "rmsnorm": (lambda: fused.rmsnorm(x, w, 1e-6), lambda: ops.rmsnorm_ref(x, w, 1e-6), 2 * x.numel() * 2),
                "add_rmsnorm": (lambda: fused.rmsnorm(x, w, 1e-6, res), lambda: ops.rmsnorm_ref(x, w, 1e-6, res),
                                4 * x.numel() * 2),
                "rotary": (lambda: fused.apply_rotary(pos, qkv[:, :hq], qkv[:, hq:hq + hkv], cache),
                           lambda: ops.apply_rotary_ref(pos, qkv[:, :hq], qkv[:, hq:hq + hkv], cache),
                           2 * tokens * (hq + hkv) * dim * 2),
                "silu_and_mul": (lambda: fused.silu_and_mul(gate_up), lambda: ops.silu_and_mul_ref(gate_up),
                                 3 * tokens * inter * 2),
            }
            for op, (fn, ref, nbytes) in cases.items():
                ms, ref_ms = ms_graph(fn), ms_graph(ref)
                rows.append(dict(kind="fused", model=model, op=op, tokens=tokens, us=ms * 1e3, torch_us=ref_ms * 1e3,
                                 gbps=nbytes / ms / 1e6, frac_copy=nbytes / ms / 1e6 / ceil["copy_gbps"]))
    return rows


def bench_qk_norm_rope_store_kv() -> list[dict]:
    """A layer's one kernel between the qkv GEMM and attention against the separate launches it replaced
    (per-head q and k RMSNorm for qwen3, rotary, store_kv), on views of a qkv output as the layer has them."""
    rows = []
    for model, (hq, hkv, dim, _, _) in MODELS.items():
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        cache = ops.build_cos_sin_cache(inv_freq, 32768).cuda()
        k_cache, v_cache = (torch.zeros(1 << 16, hkv, dim, device="cuda", dtype=BF16) for _ in range(2))
        norm = {}
        if model.startswith("qwen3"):
            norm = dict(q_norm_weight=torch.randn(dim, device="cuda", dtype=BF16),
                        k_norm_weight=torch.randn(dim, device="cuda", dtype=BF16), eps=1e-6)
        for tokens in (1, 64, 8192):
            qkv = torch.randn(tokens, (hq + 2 * hkv) * dim, device="cuda", dtype=BF16)
            q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1))
            pos = torch.randint(0, 32768, (tokens,), device="cuda")
            loc = torch.randperm(1 << 16, device="cuda")[:tokens]

            def separate():
                qn, kn = q, k
                if norm:
                    qn, kn = fused.rmsnorm(q, norm["q_norm_weight"], 1e-6), fused.rmsnorm(k, norm["k_norm_weight"], 1e-6)
                fused.apply_rotary(pos, qn, kn, cache)
                store_kv(kn, v, k_cache, v_cache, loc)

            ms = ms_graph(lambda: fused.qk_norm_rope_store_kv(pos, q, k, v, cache, k_cache, v_cache, loc, **norm))
            rows.append(dict(kind="qk_norm_rope_store_kv", model=model, tokens=tokens, us=ms * 1e3,
                             separate_us=ms_graph(separate) * 1e3))
    return rows


def bench_sampling() -> list[dict]:
    rows = []
    vocab = 151936
    for batch in (1, 64, 256):
        logits = torch.randn(batch, vocab, device="cuda") * 4
        temps = torch.full((batch,), 0.7, device="cuda")
        top_ks = torch.full((batch,), 50, device="cuda")
        top_ps = torch.full((batch,), 0.9, device="cuda")
        min_ps = torch.zeros(batch, device="cuda")
        for max_top_k in (256, 1024):
            ms = ms_graph(lambda: sampling.sample(logits, temps, top_ks, top_ps, min_ps, max_top_k=max_top_k))
            rows.append(dict(kind="sampling", batch=batch, impl=f"topk{max_top_k}", us=ms * 1e3))
        probs = logits.softmax(-1)
        for k in (256, 1024):
            ms = ms_graph(lambda: probs.topk(k, dim=-1))
            rows.append(dict(kind="sampling", batch=batch, impl=f"torch_topk{k}_only", us=ms * 1e3))
        ms = ms_graph(lambda: logits.softmax(-1).sort(dim=-1, descending=True))
        rows.append(dict(kind="sampling", batch=batch, impl="full_sort_only", us=ms * 1e3))
        rows += bench_gumbel(logits.to(BF16), temps)
    return rows


def bench_gumbel(logits: torch.Tensor, temps: torch.Tensor) -> list[dict]:
    """The decode graph's sampling of bf16 logits (one read) against the torch ops of an unfiltered draw."""
    batch, vocab = logits.shape
    rng = torch.zeros(2, dtype=torch.int64, device="cuda")
    cases = {
        "gumbel_greedy_bf16": lambda: sampling.gumbel_max_sample(logits, torch.zeros_like(temps), rng),
        "gumbel_temperature_bf16": lambda: sampling.gumbel_max_sample(logits, temps, rng),
        "torch_sample_unfiltered_bf16": lambda: sampling.sample(
            logits, temps, torch.zeros_like(temps, dtype=torch.int64), torch.ones_like(temps), torch.zeros_like(temps)),
    }
    rows = []
    for impl, fn in cases.items():
        ms = ms_graph(fn)
        rows.append(dict(kind="sampling", batch=batch, impl=impl, us=ms * 1e3, gbps=batch * vocab * 2 / ms / 1e6))
    return rows


def plot(rows: list[dict], ceil: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, model in zip(axes, MODELS):
        for ctx in (1024, 4096, 16384):
            pts = [r for r in rows if r["kind"] == "decode" and r["model"] == model and r["ctx"] == ctx]
            ax.plot([r["batch"] for r in pts], [r["gbps"] for r in pts], marker="o", label=f"ctx {ctx}")
        ax.axhline(ceil["copy_gbps"], ls="--", c="k", label=f"copy ceiling {ceil['copy_gbps']:.0f} GB/s")
        ax.set(xscale="log", xlabel="batch", ylabel="GB/s (KV + q/out)", title=f"Triton paged decode, {model}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__)
    parser.add_argument("--out", required=True, help="folder for kernels.json and kernels.png")
    parser.add_argument("--quick", action="store_true", help="fewer decode cases")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    ceil = measure_ceilings()
    print(f"device {torch.cuda.get_device_name()}  copy {ceil['copy_gbps']:.0f} GB/s  "
          f"matmul {ceil['matmul_tflops']:.0f} TFLOP/s", flush=True)
    rows = []
    for name, fn in (("decode", lambda: bench_decode(ceil, args.quick)), ("extend", lambda: bench_extend(ceil)),
                     ("store", lambda: bench_store(ceil)), ("fused", lambda: bench_fused(ceil)),
                     ("qk_norm_rope_store_kv", bench_qk_norm_rope_store_kv), ("sampling", bench_sampling)):
        part = fn()
        rows += part
        for r in part:
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
        torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                ceilings=ceil, reference_ceilings=dict(copy_gbps=4282, matmul_tflops=790),
                env={k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES",)})
    (out / "kernels.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    plot(rows, ceil, out / "kernels.png")
    print("\n%-10s %-6s %6s %6s %9s %8s %7s" % ("model", "batch", "ctx", "split", "us", "GB/s", "of copy"))
    for r in rows:
        if r["kind"] == "decode":
            print("%-10s %-6d %6d %6d %9.1f %8.0f %6.0f%%" % (r["model"], r["batch"], r["ctx"], r["splits"], r["us"],
                                                            r["gbps"], 100 * r["frac_copy"]))
    for r in rows:
        if r["kind"] == "extend" and "us" in r:
            print(f"extend {r['model']:10s} {r['case']:18s} {r['impl']:22s} {r['us']:9.1f} us {r['tflops']:6.1f} TFLOP/s")
    for r in rows:
        if r["kind"] == "qk_norm_rope_store_kv":
            print(f"qk_norm_rope_store_kv {r['model']:10s} {r['tokens']:5d} tokens {r['us']:7.1f} us "
                  f"(separate kernels {r['separate_us']:7.1f} us)")


if __name__ == "__main__":
    main()
