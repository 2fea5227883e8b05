"""FP8 (E4M3) linear layers' numerics. Weights are float8_e4m3fn with one float32 scale per output channel;
activations are quantized per token (a float32 scale per row: its amax over FP8_MAX, or the checkpoint's static
scale) right before the GEMM, so the product is `(x_q * scale_x) @ (w_q * scale_w).T`.

On a GPU with FP8 tensor cores (sm89+) the GEMM is `torch._scaled_mm` with rowwise scales (its kernel writes
bfloat16; another model dtype is cast after), or for a decode batch's few rows the Triton `fp8_rows_kernel` where
the tuner measured it faster (cuBLAS's 128-row tiles leave most SMs idle there); everywhere else the same quantized
operands are dequantized to float32 and multiplied. Everything is fixed-shape tensor work with no host sync, so it
runs inside CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

import torch

from pdserve.kernels.skinny import SkinnyTuner, skinny_choice

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# activation scales are amax * INV_FP8_MAX, the float32 reciprocal: torch on CUDA divides by a scalar that way, so
# the torch ops, the Triton kernels and every device give the same scale bits
INV_FP8_MAX = torch.tensor(1 / FP8_MAX, dtype=torch.float32).item()
MIN_SCALE = 1e-12  # an all-zero row (a padding row, a zero activation) still divides by something
FP8_MAX_ROWS = 64  # rows of a decode batch the FP8 rows kernel is tuned for; more go to quantize + _scaled_mm
PROMOTE_K = 32  # the FP8 MMA's partial sums are added in float32 every PROMOTE_K products (one MMA's K)


@dataclass(frozen=True, slots=True)
class Fp8RowsConfig:
    """A block shape of `fp8_rows_kernel`: a weight block of block_n x block_k bytes; quantize_in_kernel: the kernel
    quantizes the rows itself, else one `quantize_tokens` launch before it; split_k: programs per column block."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    quantize_in_kernel: bool
    split_k: int = 1


# the block shapes the tuner tries: the fastest of pdserve.bench.skinny_sweep --weights fp8 for each llama-3.1-8b
# projection at 1 and 64 rows (H200, 2026-11-27; rows quantized before the kernel), the 1-row ones also quantizing
# the rows in the kernel, which saves a launch where the amax pass is one load (FP8_IN_KERNEL_ROWS)
_ROW_SHAPES = ((64, 256, 4, 4, 4), (64, 256, 4, 3, 1), (32, 512, 4, 4, 1))
_BATCH_SHAPES = ((128, 256, 8, 4, 2), (64, 256, 4, 4, 2), (128, 128, 8, 4, 1), (128, 256, 8, 4, 4))
FP8_CANDIDATES = tuple(Fp8RowsConfig(bn, bk, w, s, in_kernel, split) for bn, bk, w, s, split in _ROW_SHAPES
                       for in_kernel in (True, False)) + tuple(
    Fp8RowsConfig(bn, bk, w, s, False, split) for bn, bk, w, s, split in _BATCH_SHAPES)
FP8_IN_KERNEL_ROWS = 8  # rows the kernel may quantize itself
AMAX_ELEMENTS = 16384  # the in-kernel amax pass loads up to this many elements at once (a row of K <= 16384)


def fp8_candidates(rows: int, configs: Iterable[Fp8RowsConfig] = FP8_CANDIDATES) -> tuple[Fp8RowsConfig, ...]:
    """The configs that may run `rows` rows: those quantizing in the kernel only up to FP8_IN_KERNEL_ROWS."""
    return tuple(cfg for cfg in configs if rows <= FP8_IN_KERNEL_ROWS or not cfg.quantize_in_kernel)


SPLIT_COUNTERS = 8192  # column blocks a split-K launch may count in (N / block_n)
_split_counters: dict[tuple[torch.device, int], torch.Tensor] = {}


def split_counters(device: torch.device) -> torch.Tensor:
    """The zeroed int32 counters split-K launches on this device's current stream count in; each launch leaves
    them zero again, and launches on one stream run one after another, so they never share a live counter."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    if key not in _split_counters:
        _split_counters[key] = torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)
    return _split_counters[key]


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] in any float dtype -> (float8 [N, K], float32 scales [N]): each row's amax maps to FP8_MAX."""
    scale = (weight.abs().amax(dim=1).float() / FP8_MAX).clamp(min=MIN_SCALE)
    return to_fp8(weight.float() / scale[:, None]), scale


def quantize_tokens(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 [M, K], float32 scales [M, 1]): per token (amax / FP8_MAX), or the static scale. On
    CUDA one Triton kernel computes the same."""
    if x.is_cuda:
        return quantize_tokens_triton(x, static_scale)
    return quantize_tokens_torch(x, static_scale)


def quantize_tokens_torch(x: torch.Tensor, static_scale: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_tokens` in torch ops, on any device."""
    if static_scale is None:
        scale = (x.abs().amax(dim=-1, keepdim=True).float() * INV_FP8_MAX).clamp(min=MIN_SCALE)
    else:
        scale = static_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return to_fp8(x.float() * torch.reciprocal(scale)), scale


def quantize_tokens_triton(x: torch.Tensor, static_scale: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_tokens` of a 2-D x in one Triton kernel: the same bytes and scales."""
    import triton

    from pdserve.quantization.fp8_triton import quantize_tokens_kernel

    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    quantize_tokens_kernel[(m,)](
        x, q, scale, static_scale if static_scale is not None else scale, x.stride(0), q.stride(0), k,
        FP8_MAX=FP8_MAX, INV_FP8_MAX=INV_FP8_MAX, MIN_SCALE=MIN_SCALE, STATIC=static_scale is not None, BLOCK=block,
        num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16,
    )
    return q, scale


def fp8_rows_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    input_scale: torch.Tensor | None, bias: torch.Tensor | None, cfg: Fp8RowsConfig) -> torch.Tensor:
    """`fp8_linear` of a decode batch's M <= FP8_MAX_ROWS rows through `fp8_rows_kernel` (the FP8 weight streamed
    once into the MMA): the rows quantized by the kernel itself or by `quantize_tokens` first, as cfg says (the same
    bytes and scales either way); float32 sums, rounded once to x's dtype."""
    import triton

    from pdserve.quantization.fp8_triton import fp8_rows_kernel

    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    assert m <= FP8_MAX_ROWS and weight.shape[1] == k and weight.stride(1) == 1
    assert m <= FP8_IN_KERNEL_ROWS or not cfg.quantize_in_kernel
    if cfg.quantize_in_kernel:
        rows, row_scale = x, weight_scale  # row_scale: unused
    else:
        rows, row_scale = quantize_tokens(x, input_scale)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    padded_rows, column_blocks = triton.next_power_of_2(m), triton.cdiv(n, cfg.block_n)
    k_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    partial, counters = weight_scale, weight_scale  # unused unless split
    if cfg.split_k > 1:
        assert column_blocks <= SPLIT_COUNTERS
        partial = torch.empty(cfg.split_k * column_blocks * cfg.block_n * padded_rows, dtype=torch.float32,
                              device=x.device)
        counters = split_counters(x.device)
    fp8_rows_kernel[(column_blocks, cfg.split_k)](
        rows, row_scale, weight, weight_scale, input_scale if input_scale is not None else weight_scale,
        bias if bias is not None else weight_scale, out, partial, counters, m, n, k, k_split, rows.stride(0),
        weight.stride(0), out.stride(0), FP8_MAX=FP8_MAX, INV_FP8_MAX=INV_FP8_MAX, MIN_SCALE=MIN_SCALE,
        QUANTIZE=cfg.quantize_in_kernel, STATIC=input_scale is not None, HW_CAST=x.is_cuda, ROWS=padded_rows,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        PROMOTE_K=PROMOTE_K, SPLIT_K=cfg.split_k, num_warps=cfg.num_warps,
        AMAX_BLOCK=min(triton.next_power_of_2(k), max(cfg.block_k, AMAX_ELEMENTS // padded_rows)),
        num_stages=cfg.num_stages,
    )
    return out


def tune_fp8_rows(rows: Iterable[int], layers: list[tuple[torch.Tensor, torch.Tensor]], x_dtype: torch.dtype
                  ) -> dict:
    """Times `quantized_linear` against the rows kernel's configs on each (FP8 weight, weight scale) shape for each
    row count of x_dtype activations; `fp8_linear` then takes the faster (see `SkinnyTuner`)."""
    scales = {(w.shape[0], w.shape[1]): s for w, s in layers}
    return SkinnyTuner(rows, "FP8 rows linear", fp8_candidates, FP8_MAX_ROWS).tune(
        [w for w, _ in layers], x_dtype,
        baseline=lambda x, w: quantized_linear(x, w, scales[tuple(w.shape)], None, None),
        candidate=lambda x, w, cfg: fp8_rows_linear(x, w, scales[tuple(w.shape)], None, None, cfg),
    )


def to_fp8(values: torch.Tensor) -> torch.Tensor:
    """float32 values already divided by their scale -> float8, saturating at +-FP8_MAX (a static scale can
    leave values beyond it)."""
    return values.clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] times the FP8 weight [N, K] with its scales [N] (+ bias), in x's dtype: few rows on CUDA through
    the FP8 rows kernel where `tune_fp8_rows` chose it for the shape, else quantize, then the GEMM."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.is_cuda and (cfg := skinny_choice(rows, weight)) is not None:
        out = fp8_rows_linear(rows, weight, weight_scale, input_scale, bias, cfg)
    else:
        out = quantized_linear(rows, weight, weight_scale, input_scale, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def quantized_linear(rows: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """`fp8_linear` of 2-D rows: `quantize_tokens`, then the tensor-core GEMM (or its dequantizing fallback)."""
    x_q, x_scale = quantize_tokens(rows, input_scale)
    gemm = scaled_mm if has_fp8_gemm(rows.device) else dequantized_mm
    out = gemm(x_q, x_scale, weight, weight_scale, rows.dtype)
    return out if bias is None else out + bias


def scaled_mm(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """The FP8 tensor-core GEMM with rowwise scales (K and N multiples of 16)."""
    out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                           out_dtype=torch.bfloat16)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


def dequantized_mm(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """The same product where no FP8 GEMM exists: both operands dequantized to float32, then multiplied."""
    return ((x_q.float() * x_scale) @ (weight.float() * weight_scale[:, None]).t()).to(out_dtype)


def has_fp8_gemm(device: torch.device) -> bool:
    return device.type == "cuda" and _capability(device.index) >= (8, 9)


@lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
