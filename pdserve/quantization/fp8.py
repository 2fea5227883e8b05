"""FP8 (E4M3) linear layers' numerics. Weights are float8_e4m3fn with one float32 scale per output channel;
activations are quantized per token (a float32 scale per row: its amax over FP8_MAX, or the checkpoint's static
scale), so the product is `(x_q * scale_x) @ (w_q * scale_w).T`: by the kernel before the layer where that is a
RMSNorm or SiLU-and-mul (it hands over `Fp8Rows`), else right before the GEMM.

On a GPU with FP8 tensor cores (sm89+) the GEMM is `torch._scaled_mm` with rowwise scales (its kernel writes
bfloat16; another model dtype is cast after), or for a decode batch's few rows the Triton `fp8_rows_kernel` where
the tuner measured it faster (cuBLAS's 128-row tiles leave most SMs idle there); everywhere else the same quantized
operands are dequantized to float32 and multiplied. Everything is fixed-shape tensor work with no host sync, so it
runs inside CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache

import torch

from pdserve.kernels import quantize_tokens, silu_and_mul
from pdserve.kernels.fp8_rows import FP8, FP8_MAX, MIN_SCALE, Fp8Output, Fp8Rows, to_fp8  # the format, here too
from pdserve.kernels.pending_rows import PendingNorm, RowsWithAmax
from pdserve.kernels.rope_store import RopeStore
from pdserve.kernels.skinny import SkinnyTuner, skinny_choice
from pdserve.mem_cache.kv_quant import float32, fp8_max, is_fp8

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
# projection at 1 and 64 rows (H200, 2026-11-27, rows quantized before the kernel; and, the last three row shapes
# and the last batch shape, H100, the same day, each call's weight read from memory), the 1-row ones also
# quantizing the rows in the kernel, which saves a launch where the amax pass is one load (FP8_IN_KERNEL_ROWS)
_ROW_SHAPES = ((64, 256, 4, 4, 4), (64, 256, 4, 3, 1), (32, 512, 4, 4, 1), (64, 512, 4, 3, 1), (64, 512, 4, 4, 1),
               (32, 256, 4, 3, 1))
_BATCH_SHAPES = ((128, 256, 8, 4, 2), (64, 256, 4, 4, 2), (128, 128, 8, 4, 1), (128, 256, 8, 4, 4),
                 (64, 256, 4, 3, 2))
FP8_IN_KERNEL_ROWS = 8  # rows the kernel may quantize itself
# rows up to which the tuner times the kernel computing pending RMSNorm rows itself: with 4 and 8 rows it lost on
# every llama-3.1-8b shape (H100, 2026-11-27, benchmarks/results/2026-11-27g), with 1 it won on qkv and gate_up,
# with 2 on qkv
FUSED_NORM_ROWS = 2
FUSED_SILU_ROWS = 2  # rows up to which the tuner times the rows kernel computing SiLU-and-mul of its product
FUSED_ROPE_ROWS = 2  # and doing the rotary and the KV store after a qkv product
FUSED_AMAX_ROWS = 2  # and reading the amax parts its rows come with (`RowsWithAmax`)
FP8_CANDIDATES = tuple(Fp8RowsConfig(bn, bk, w, s, in_kernel, split) for bn, bk, w, s, split in _ROW_SHAPES
                       for in_kernel in (True, False)) + tuple(
    Fp8RowsConfig(bn, bk, w, s, False, split) for bn, bk, w, s, split in _BATCH_SHAPES)
AMAX_ELEMENTS = 16384  # the in-kernel amax pass loads up to this many elements at once (a row of K <= 16384)


HOPPER_SHARED_MEMORY = 232448  # bytes a program may hold on an H100 / H200 (227 KiB)


def preloads(padded_rows: int) -> bool:
    """Whether the rows kernel reads its first weight block before waiting for the kernel before (PRELOAD): for as
    few rows as it may quantize itself."""
    return padded_rows <= FP8_IN_KERNEL_ROWS


def fp8_candidates(rows: int, configs: Iterable[Fp8RowsConfig] = FP8_CANDIDATES) -> tuple[Fp8RowsConfig, ...]:
    """The configs that may run `rows` rows: those quantizing in the kernel only up to FP8_IN_KERNEL_ROWS, and
    those whose pipelined weight and row blocks (num_stages of each, one more where the first is preloaded; FP8
    weight bytes, row elements in FP8 or, where the kernel quantizes them, the model dtype's two bytes) fit a Hopper
    SM's shared memory at this many rows (padded to a power of 2, as launched)."""
    padded = 1 << max(rows - 1, 0).bit_length()
    return tuple(cfg for cfg in configs if (rows <= FP8_IN_KERNEL_ROWS or not cfg.quantize_in_kernel)
                 and (cfg.num_stages + preloads(padded)) * cfg.block_k
                 * (cfg.block_n + padded * (1 + cfg.quantize_in_kernel)) <= HOPPER_SHARED_MEMORY)


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


def fp8_rows_linear(x: torch.Tensor | Fp8Rows | PendingNorm | RowsWithAmax, weight: torch.Tensor,
                    weight_scale: torch.Tensor, input_scale: torch.Tensor | None, bias: torch.Tensor | None,
                    cfg: Fp8RowsConfig, gated: bool = False, rope: RopeStore | None = None
                    ) -> torch.Tensor | RowsWithAmax:
    """`fp8_linear` of a decode batch's M <= FP8_MAX_ROWS rows through `fp8_rows_kernel` (the FP8 weight streamed
    once into the MMA): rows already quantized (`Fp8Rows`), or quantized by the kernel itself (their amax from the
    parts of `RowsWithAmax` where given) or by `quantize_tokens` first, as cfg says (the same bytes and scales
    every way), or computed by the kernel itself from a pending RMSNorm (`PendingNorm`, cfg quantizing in the
    kernel); float32 sums, rounded once to the rows' dtype. gated (a [gate; up] weight, no bias): SiLU(gate) * up,
    as `silu_and_mul` of the product, with its amax parts (`RowsWithAmax`). rope (a qkv weight): the product with
    `rope.apply` done to it (q and k rotated, k and v stored into the cache)."""
    import triton

    from pdserve.kernels.pdl import launch_options
    from pdserve.quantization.fp8_triton import fp8_rows_kernel

    residual = norm_weight = residual_out = weight_scale  # a pending RMSNorm's operands: unread without one
    eps = 0.0
    parts = None  # amax parts the kernel reads
    if isinstance(x, RowsWithAmax):
        parts = x.amax_parts if cfg.quantize_in_kernel and input_scale is None else None
        x = x.values
    if isinstance(x, Fp8Rows):
        assert not cfg.quantize_in_kernel
        rows, row_scale, dtype = x.values, x.scale, x.dtype
    elif isinstance(x, PendingNorm):
        assert cfg.quantize_in_kernel
        rows, residual, norm_weight, residual_out, eps = x.hidden, x.residual, x.weight, x.residual_out, x.eps
        row_scale, dtype = weight_scale, x.dtype
    else:
        x, dtype = (x if x.stride(1) == 1 else x.contiguous()), x.dtype
        # quantized in the kernel: no row scales to pass (weight_scale stands in, unread)
        rows, row_scale = (x, weight_scale) if cfg.quantize_in_kernel else quantize_tokens(x, input_scale)
    m, k = rows.shape
    n = weight.shape[0]
    assert m <= FP8_MAX_ROWS and weight.shape[1] == k and weight.stride(1) == 1 and rows.stride(1) == 1
    assert m <= FP8_IN_KERNEL_ROWS or not cfg.quantize_in_kernel
    assert not gated or (bias is None and n % 2 == 0)
    assert parts is None or parts.shape[0] == m
    assert rope is None or (not gated and n == (rope.num_q_heads + 2 * rope.num_kv_heads) * rope.head_dim
                            and rope.head_dim // 2 % (cfg.block_n // 2) == 0)
    out = torch.empty((m, n // 2 if gated else n), dtype=dtype, device=rows.device)
    paired = gated or rope is not None  # blocks of BLOCK_N / 2 row pairs
    padded_rows, column_blocks = triton.next_power_of_2(m), triton.cdiv(n // (1 + paired), cfg.block_n // (1 + paired))
    amax_out = torch.empty((m, column_blocks), dtype=torch.float32, device=rows.device) if gated else None
    k_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    partial, counters = weight_scale, weight_scale  # unused unless split
    if cfg.split_k > 1:
        assert column_blocks <= SPLIT_COUNTERS
        partial = torch.empty(cfg.split_k * column_blocks * cfg.block_n * padded_rows, dtype=torch.float32,
                              device=rows.device)
        counters = split_counters(rows.device)
    amax_block = min(triton.next_power_of_2(k), max(cfg.block_k, AMAX_ELEMENTS // padded_rows))
    fp8_rows_kernel[(column_blocks, cfg.split_k)](
        rows, row_scale, weight, weight_scale, input_scale if input_scale is not None else weight_scale,
        bias if bias is not None else weight_scale, out, partial, counters, residual, norm_weight, residual_out,
        m, n, k, k_split, rows.stride(0), weight.stride(0), out.stride(0), residual.stride(0), residual_out.stride(0),
        eps, **_rope_operands(rope, weight_scale), **_amax_operands(parts, amax_out, weight_scale),
        **Fp8Output(input_scale).constants(rows.device),
        NORM=isinstance(x, PendingNorm), GATED=gated,
        QUANTIZE=cfg.quantize_in_kernel, ROWS=padded_rows,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        PROMOTE_K=PROMOTE_K, SPLIT_K=cfg.split_k, num_warps=cfg.num_warps,
        AMAX_BLOCK=amax_block, ONE_BLOCK=amax_block >= k, PRELOAD=preloads(padded_rows),
        num_stages=cfg.num_stages, **launch_options(rows.device),
    )
    return out if amax_out is None else RowsWithAmax(out, amax_out)


def _amax_operands(parts: torch.Tensor | None, amax_out: torch.Tensor | None, unused: torch.Tensor) -> dict:
    """The rows kernel's amax parts to read (PARTS) and to write (a gated product's), or stand-ins it does not
    touch."""
    import triton

    read, written = (unused if parts is None else parts), (unused if amax_out is None else amax_out)
    return dict(AmaxParts=read, stride_ap=read.stride(0), num_parts=0 if parts is None else parts.shape[1],
                AmaxOut=written, stride_ao=written.stride(0),
                PARTS=0 if parts is None else max(2, triton.next_power_of_2(parts.shape[1])))


def _rope_operands(rope: RopeStore | None, unused: torch.Tensor) -> dict:
    """The rows kernel's arguments for `rope` (ROPE), or stand-ins it does not read."""
    if rope is None:
        return dict(Pos=unused, Loc=unused, CosSin=unused, KCache=unused, VCache=unused, stride_c=0, stride_ct=0,
                    k_inv_scale=1.0, v_inv_scale=1.0, ROPE=False, HEADS_Q=1, HEADS_KV=1, HALF=1, KV_QUANT=False,
                    KV_FP8_MAX=0.0)
    assert rope.cos_sin_cache.shape[1] == rope.head_dim
    assert rope.k_cache.is_contiguous() and rope.v_cache.is_contiguous()
    quant = is_fp8(rope.k_cache.dtype)
    return dict(Pos=rope.positions, Loc=rope.loc, CosSin=rope.cos_sin_cache, KCache=rope.k_cache, VCache=rope.v_cache,
                stride_c=rope.cos_sin_cache.stride(0), stride_ct=rope.k_cache.stride(0),
                k_inv_scale=float32(1.0 / rope.k_scale), v_inv_scale=float32(1.0 / rope.v_scale), ROPE=True,
                HEADS_Q=rope.num_q_heads, HEADS_KV=rope.num_kv_heads, HALF=rope.head_dim // 2, KV_QUANT=quant,
                KV_FP8_MAX=fp8_max(rope.k_cache.dtype) if quant else 0.0)


def tune_fp8_rows(rows: Iterable[int], layers: list[tuple[torch.Tensor, torch.Tensor]], x_dtype: torch.dtype,
                  gated: Iterable[torch.Tensor] = (), rotary: Iterable[tuple[torch.Tensor, int, int, int]] = (),
                  kv_dtype: torch.dtype | None = None, amax_parts: Iterable[tuple[torch.Tensor, int]] = ()) -> dict:
    """Times `quantized_linear` against the rows kernel's configs on each (FP8 weight, weight scale) shape for each
    row count, for x_dtype activations and for rows a RMSNorm or SiLU kernel quantized already (`Fp8Rows`); then,
    up to FUSED_NORM_ROWS rows, the rows kernel computing pending RMSNorm rows itself (`PendingNorm`) against the
    RMSNorm kernel followed by what was chosen for its `Fp8Rows`; then, for the `gated` weights ([gate; up]) up to
    FUSED_SILU_ROWS rows, the rows kernel computing SiLU(gate) * up of pending RMSNorm rows against what was chosen
    for them followed by the SiLU-and-mul kernel; for the `amax_parts` weights, whose rows come with their amax in
    parts of so many columns (`RowsWithAmax`: a down projection after the gated kernel, an o projection after the
    decode attention), the rows kernel reading the parts against the choice for plain rows; for the `rotary` qkv
    weights (with their q heads, kv heads and head size; the cache in kv_dtype) the rows kernel doing the rotary
    and the cache store against the rotary kernel after the product. `fp8_linear`, `fp8_gated_linear` and
    `fp8_rope_linear` then take the faster for their input (see `SkinnyTuner`)."""
    scales = {(w.shape[0], w.shape[1]): s for w, s in layers}
    weights = [w for w, _ in layers]

    def baseline(x, w):
        return quantized_linear(x, w, scales[tuple(w.shape)], None, None)

    def candidate(x, w, cfg):
        return fp8_rows_linear(x, w, scales[tuple(w.shape)], None, None, cfg)

    def norm_first(x, w):  # pending RMSNorm rows without the fused kernel
        return fp8_linear(x.evaluate(), w, scales[tuple(w.shape)])

    def silu_after(x, w):  # the product as chosen above, then the SiLU-and-mul kernel
        return silu_and_mul(fp8_linear(x, w, scales[tuple(w.shape)]))

    def gated_candidate(x, w, cfg):
        return _epilogue_rows_linear(x, w, scales[tuple(w.shape)], None, None, cfg, gated=True)

    def plain_first(x, w):  # the rows as they are, as chosen above
        return fp8_linear(x.evaluate(), w, scales[tuple(w.shape)])

    amax_parts = list(amax_parts)
    parts_of = {w.shape[1]: part for w, part in amax_parts}  # by the rows' width: prepare sees only the rows
    heads, samples = {tuple(w.shape): shape for w, *shape in rotary}, {}

    def rope_for(x, w):  # made on the first (untimed) call, outside the graph
        key = (x.shape[0], tuple(w.shape))
        if key not in samples:
            samples[key] = RopeStore.sample(x.shape[0], *heads[tuple(w.shape)], kv_dtype or x_dtype, w.device)
        return samples[key]

    def rope_after(x, w):  # the product as chosen above, then the rotary kernel
        return rope_for(x, w).apply(fp8_linear(x, w, scales[tuple(w.shape)]))

    def rope_candidate(x, w, cfg):
        return _epilogue_rows_linear(x, w, scales[tuple(w.shape)], None, None, cfg, rope=rope_for(x, w))

    report = SkinnyTuner(rows, "FP8 rows linear", fp8_candidates, FP8_MAX_ROWS).tune(
        weights, x_dtype, baseline, candidate)
    prequantized = SkinnyTuner(rows, "FP8 rows linear, rows quantized before", fp8_candidates(FP8_MAX_ROWS),
                               FP8_MAX_ROWS).tune(weights, x_dtype, baseline, candidate,
                                                  prepare=lambda x: Fp8Rows(*quantize_tokens(x), x.dtype))
    fused_norm = SkinnyTuner(rows, "FP8 rows linear computing pending RMSNorm rows", _in_kernel_candidates,
                             FUSED_NORM_ROWS).tune(weights, x_dtype, norm_first, candidate, prepare=pending_norm)
    fused_silu = SkinnyTuner(rows, "FP8 rows linear computing SiLU-and-mul", _row_candidates, FUSED_SILU_ROWS,
                             epilogue="silu_and_mul").tune(list(gated), x_dtype, silu_after, gated_candidate,
                                                           prepare=pending_norm)
    with_parts = SkinnyTuner(rows, "FP8 rows linear reading amax parts", _in_kernel_candidates,
                             FUSED_AMAX_ROWS).tune([w for w, _ in amax_parts], x_dtype, plain_first, candidate,
                                                   prepare=lambda x: rows_with_amax(x, parts_of[x.shape[1]]))
    fused_rope = SkinnyTuner(rows, "FP8 rows linear doing the rotary and the KV store", _row_candidates,
                             FUSED_ROPE_ROWS, epilogue="rope_store").tune([w for w, *_ in rotary], x_dtype,
                                                                         rope_after, rope_candidate,
                                                                         prepare=pending_norm)
    return {**report, **{(m, n, k, "quantized"): times for (m, n, k), times in prequantized.items()},
            **{(m, n, k, "rmsnorm"): times for (m, n, k), times in fused_norm.items()},
            **{(m, n, k, "silu_and_mul"): times for (m, n, k), times in fused_silu.items()},
            **{(m, n, k, "amax_parts"): times for (m, n, k), times in with_parts.items()},
            **{(m, n, k, "rope_store"): times for (m, n, k), times in fused_rope.items()}}


def _row_candidates(rows: int) -> tuple[Fp8RowsConfig, ...]:
    """The configs of the 1-row block shapes (a few rows' decode, where the fused epilogues are timed)."""
    return fp8_candidates(rows, FP8_CANDIDATES[: 2 * len(_ROW_SHAPES)])


def _in_kernel_candidates(rows: int) -> tuple[Fp8RowsConfig, ...]:
    return tuple(cfg for cfg in fp8_candidates(rows) if cfg.quantize_in_kernel)


def pending_norm(x: torch.Tensor) -> PendingNorm:
    """Pending RMSNorm rows of x's shape, as a decoder layer hands them over (x + a residual, a norm weight)."""
    return PendingNorm(x, torch.randn_like(x), torch.rand(x.shape[1], dtype=x.dtype, device=x.device) + 0.5, 1e-6,
                       Fp8Output(), torch.empty_like(x))


GATED_PART = 32  # columns of a gated product's amax parts (block_n 64: 32 pairs), as the tuner hands them over


def rows_with_amax(x: torch.Tensor, part: int = GATED_PART) -> RowsWithAmax:
    """x with its amax in parts of `part` columns (the last one shorter), as a kernel leaves them."""
    parts = torch.stack([c.abs().amax(dim=1).float() for c in x.split(part, dim=1)], dim=1)
    return RowsWithAmax(x, parts)


def fp8_linear(x: torch.Tensor | Fp8Rows | PendingNorm | RowsWithAmax, weight: torch.Tensor,
               weight_scale: torch.Tensor, input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x [..., K] times the FP8 weight [N, K] with its scales [N] (+ bias), in x's dtype: few rows on CUDA through
    the FP8 rows kernel where `tune_fp8_rows` chose it for the shape and kind of rows, else quantize, then the GEMM.
    x may be `Fp8Rows` (2-D), quantized by the kernel before, or `PendingNorm` or `RowsWithAmax` (2-D), which the
    rows kernel takes as they are where that was chosen and which are evaluated first anywhere else: the output is
    then 2-D."""
    two_d = isinstance(x, (Fp8Rows, PendingNorm, RowsWithAmax))
    rows = x if two_d else x.reshape(-1, x.shape[-1])
    cfg = skinny_choice(rows, weight) if weight.is_cuda else None
    if isinstance(rows, (PendingNorm, RowsWithAmax)) and cfg is None:  # the plain rows, then their choice
        rows = rows.evaluate()
        cfg = skinny_choice(rows, weight) if weight.is_cuda else None
    if cfg is not None:
        out = fp8_rows_linear(rows, weight, weight_scale, input_scale, bias, cfg)
    else:
        out = quantized_linear(rows, weight, weight_scale, input_scale, bias)
    return out if two_d else out.reshape(*x.shape[:-1], weight.shape[0])


def fp8_gated_linear(x: torch.Tensor | Fp8Rows | PendingNorm, weight: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: torch.Tensor | None = None) -> torch.Tensor | RowsWithAmax:
    """SiLU(gate) * up of x times a [gate; up] FP8 weight (no bias): `silu_and_mul` of `fp8_linear`, or the rows
    kernel computing it (see `_with_epilogue`), which hands over each row's amax in parts too (`RowsWithAmax`,
    for 2-D x)."""
    return _with_epilogue(x, weight, weight_scale, input_scale, None, "silu_and_mul", silu_and_mul, gated=True)


def fp8_rope_linear(x: torch.Tensor | Fp8Rows | PendingNorm, weight: torch.Tensor, weight_scale: torch.Tensor,
                    input_scale: torch.Tensor | None, bias: torch.Tensor | None, rope: RopeStore) -> torch.Tensor:
    """x times a qkv FP8 weight, then `rope.apply` (q and k rotated, k and v stored into the cache), or the rows
    kernel doing all of it (see `_with_epilogue`); returns the qkv rows."""
    return _with_epilogue(x, weight, weight_scale, input_scale, bias, "rope_store", rope.apply, rope=rope)


def _with_epilogue(x: torch.Tensor | Fp8Rows | PendingNorm, weight: torch.Tensor, weight_scale: torch.Tensor,
                   input_scale: torch.Tensor | None, bias: torch.Tensor | None, epilogue: str,
                   unfused: Callable[[torch.Tensor], torch.Tensor], **kernel_epilogue) -> torch.Tensor:
    """unfused(fp8_linear(...)), or, for a decode batch's few rows where `tune_fp8_rows` chose it for `epilogue`,
    the rows kernel computing the same as it writes (the epilogue kernel's launch and its gap in the decode graph
    saved)."""
    two_d = isinstance(x, (Fp8Rows, PendingNorm))
    rows = x if two_d else x.reshape(-1, x.shape[-1])
    cfg = skinny_choice(rows, weight, epilogue) if weight.is_cuda else None
    if cfg is None:
        return unfused(fp8_linear(x, weight, weight_scale, input_scale, bias))
    out = _epilogue_rows_linear(rows, weight, weight_scale, input_scale, bias, cfg, **kernel_epilogue)
    if two_d or x.dim() == 2:
        return out
    values = out.evaluate() if isinstance(out, RowsWithAmax) else out
    return values.reshape(*x.shape[:-1], values.shape[-1])


def _epilogue_rows_linear(rows: torch.Tensor | Fp8Rows | PendingNorm, weight: torch.Tensor,
                          weight_scale: torch.Tensor, input_scale: torch.Tensor | None, bias: torch.Tensor | None,
                          cfg: Fp8RowsConfig, **kernel_epilogue) -> torch.Tensor | RowsWithAmax:
    """`fp8_rows_linear` with an epilogue; pending RMSNorm rows are computed by the kernel where cfg quantizes in
    the kernel, else by the RMSNorm kernel first."""
    if isinstance(rows, PendingNorm) and not cfg.quantize_in_kernel:
        rows = rows.evaluate()
    return fp8_rows_linear(rows, weight, weight_scale, input_scale, bias, cfg, **kernel_epilogue)


def quantized_linear(rows: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """`fp8_linear` of 2-D rows: `quantize_tokens` (unless `Fp8Rows`), then the tensor-core GEMM (or its
    dequantizing fallback)."""
    if isinstance(rows, Fp8Rows):
        x_q, x_scale, dtype = rows.values, rows.scale, rows.dtype
    else:
        (x_q, x_scale), dtype = quantize_tokens(rows, input_scale), rows.dtype
    gemm = scaled_mm if has_fp8_gemm(x_q.device) else dequantized_mm
    out = gemm(x_q, x_scale, weight, weight_scale, dtype)
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
