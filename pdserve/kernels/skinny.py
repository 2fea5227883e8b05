"""Linear layers for a few rows (decode at batch 1-8): a Triton matrix-vector kernel that streams the weight once,
chosen per (rows, out, in) shape only where it measured faster than cuBLAS on this GPU.

At batch 1 a decode step is the weights read once; cuBLAS reaches the copy ceiling on the large projections but
not on the small ones (H200, 2026-11-23, inside CUDA graphs: llama-3.1-8b qkv 15.9 us, skinny 14.7; o_proj 10.3
vs 8.7; qwen3-0.6b o_proj 12.3 vs 5.1; gate_up stays on cuBLAS, which reads it at the copy ceiling). `SkinnyTuner.tune` times both on the real weight shapes once, before the CUDA
graphs are captured; `linear` then routes each call by the recorded choice (cuBLAS for any shape not tuned).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

MAX_ROWS = 8  # rows padded to one 16-row MMA tile; above this cuBLAS's tiles are the better fit
ROW_TILE = 16


@dataclass(frozen=True, slots=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# the block shapes that won some shape of pdserve.bench.skinny_sweep on an H200 (2026-11-23)
CANDIDATES = (
    SkinnyConfig(32, 256, 4, 4),
    SkinnyConfig(16, 256, 4, 3),
    SkinnyConfig(64, 128, 4, 4),
    SkinnyConfig(32, 128, 4, 3),
)

_choice: dict[tuple[int, int, int, torch.dtype], SkinnyConfig | None] = {}  # None: cuBLAS measured faster


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the skinny kernel where `SkinnyTuner` chose it for this shape."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS:
        cfg = _choice.get((x.shape[0], weight.shape[0], weight.shape[1], weight.dtype))
        if cfg is not None:
            return skinny_linear(x, weight, bias, cfg)
    return F.linear(x, weight, bias)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: SkinnyConfig
                  ) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] @ weight[N, K]^T (+ bias) in fp32, rounded once to x's dtype; weight rows contiguous."""
    import triton

    from pdserve.kernels.skinny_triton import skinny_kernel

    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    skinny_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        ROWS=ROW_TILE, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_BIAS=bias is not None,
        EVEN_K=k % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _median_us(fn, reps: int = 25) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


class SkinnyTuner:
    """Times cuBLAS and every candidate config on each weight shape for each row count; records the fastest."""

    def __init__(self, rows: list[int]):
        self.rows = [m for m in rows if m <= MAX_ROWS]

    def tune(self, weights: list[torch.Tensor]) -> dict:
        start = time.perf_counter()
        shapes = {(w.shape[0], w.shape[1], w.dtype): w for w in weights
                  if w.is_cuda and w.dim() == 2 and w.dtype in (torch.bfloat16, torch.float16)}
        report = {}
        for (n, k, dtype), w in shapes.items():
            for m in self.rows:
                x = torch.randn(m, k, device=w.device, dtype=dtype)
                cublas = _median_us(lambda: F.linear(x, w))
                timed = [(_median_us(lambda c=c: skinny_linear(x, w, None, c)), c) for c in CANDIDATES]
                best_us, best = min(timed, key=lambda t: t[0])
                _choice[(m, n, k, dtype)] = best if best_us < cublas else None
                report[(m, n, k)] = (cublas, best_us)
        logger.info("skinny linear tuned %d shapes x %d row counts in %.1f s; faster than cuBLAS on %d of %d",
                    len(shapes), len(self.rows), time.perf_counter() - start,
                    sum(c is not None for c in _choice.values()), len(_choice))
        return report
