"""Host time per call: FlashAttention-4 varlen (fresh and paged) vs pdserve's Triton extend, on tiny shapes."""

import time, torch
from flash_attn.cute import flash_attn_varlen_func as fa
from pdserve.kernels.attention import extend_attention

H, HKV, D, T = 32, 8, 128, 16
q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(T, HKV, D, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
kc = torch.randn(64, 16, HKV, D, device="cuda", dtype=torch.bfloat16)
vc = torch.randn_like(kc)
table = torch.arange(1, 33, dtype=torch.int32, device="cuda")[None]
i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")
out = torch.empty_like(q)
calls = {
    "fa4 fresh": lambda: fa(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=T, max_seqlen_k=T, causal=True),
    "fa4 paged": lambda: fa(
        q, kc, vc, cu_seqlens_q=cu, max_seqlen_q=T, seqused_k=i32([T + 256]), page_table=table, causal=True
    ),
    "triton extend": lambda: extend_attention(
        q, kc.view(-1, HKV, D), vc.view(-1, HKV, D), table, i32([256]), i32([T]), i32([0]), T, out, 0.088, 16
    ),
}
for name, fn in calls.items():
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(200):
        fn()
    host = (time.perf_counter() - t) / 200
    torch.cuda.synchronize()
    print(f"{name:14s} host {1e6 * host:7.1f} us per call")
