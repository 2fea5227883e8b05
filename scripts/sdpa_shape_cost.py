"""What a new prompt length costs torch SDPA on this GPU (issue 21's cold start): the first call at each of 12 new
lengths against the same lengths again, with PyTorch's default backend choice and with FlashAttention only, the
llama-3.1-8b heads (32 q / 8 kv, head_dim 128, bf16, causal, GQA). Prints the backend torch picks by default.

python scripts/sdpa_shape_cost.py
"""

from __future__ import annotations

import random
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def call_ms(n: int, backends: list[SDPBackend] | None) -> float:
    q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    torch.cuda.synchronize()
    start = time.perf_counter()
    if backends is None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        with sdpa_kernel(backends):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    q = torch.randn(1, 32, 1000, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 1000, 128, device="cuda", dtype=torch.bfloat16)
    choice = torch._fused_sdp_choice(q, k, k, None, 0.0, True, enable_gqa=True)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "default SDPA backend:", SDPBackend(choice).name)
    rng = random.Random(0)
    for label, backends in (("flash only", [SDPBackend.FLASH_ATTENTION]), ("default", None)):
        lengths = [rng.randrange(1024, 8192) for _ in range(12)]
        first = [call_ms(n, backends) for n in lengths]
        again = [call_ms(n, backends) for n in lengths]
        print(f"{label:10s} new lengths: median {statistics.median(first):7.2f} ms, max {max(first):7.2f};"
              f"  the same lengths again: median {statistics.median(again):7.2f} ms, max {max(again):7.2f}")


if __name__ == "__main__":
    main()
