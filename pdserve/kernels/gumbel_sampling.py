"""Triton kernels of `sampling.gumbel_max_sample` (semantics, random stream and tie rule are documented there).

Two launches per call, both CUDA-graph safe (no host sync, every shape fixed by the batch size):
1. `_gumbel_sample_split_kernel`, grid (rows, splits): each program scans whole tiles of one row's vocabulary slice
   once, in the logits' own dtype, keeping per lane the best score and its column, and writes the slice's best.
2. `_gumbel_sample_row_kernel`, grid (rows,): the best over a row's splits, written as the token; program 0 then
   advances the draw counter, once every program of step 1 has read it.
The split count only spreads small batches over the GPU: the random stream and the tie rule make the tokens the
same for any split count, so a graph captured for a padded batch samples what an eager call samples.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TARGET_PROGRAMS = 512  # programs of step 1: a few waves of a Hopper GPU's 132 SMs, for any batch size
NO_TOKEN = tl.constexpr(2**31 - 1)  # a lane or split that saw no finite score


@triton.jit
def _scan_quarter(best_val, best_col, row_start, cols, V, inv_t, bits, NOISY: tl.constexpr):
    """Folds one quarter tile into the lanes' best: score = logit greedy, logit / T + Gumbel noise otherwise."""
    score = tl.load(row_start + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    if NOISY:
        u = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # (0, 1): 23 random bits, centred
        score = score * inv_t - tl.log(-tl.log(u))
    better = score > best_val  # strictly: a lane keeps its earliest column on ties; NaN never wins
    return tl.where(better, score, best_val), tl.where(better, cols, best_col)


@triton.jit
def _scan_tiles(row_start, first_tile, last_tile, V, inv_t, seed, row_ctr, step_lo, step_hi, lanes,
                QUARTER: tl.constexpr, NOISY: tl.constexpr):
    """(best score, its lowest column) over tiles [first_tile, last_tile) of one row."""
    best_val = tl.full([QUARTER], float("-inf"), tl.float32)
    best_col = tl.full([QUARTER], NO_TOKEN, tl.int32)
    for tile in range(first_tile, last_tile):
        cols = tile * (4 * QUARTER) + lanes
        if NOISY:
            b0, b1, b2, b3 = tl.random.philox(seed, (tile * QUARTER + lanes).to(tl.uint32), row_ctr, step_lo, step_hi)
        else:
            b0, b1, b2, b3 = lanes, lanes, lanes, lanes  # not read
        best_val, best_col = _scan_quarter(best_val, best_col, row_start, cols, V, inv_t, b0, NOISY)
        best_val, best_col = _scan_quarter(best_val, best_col, row_start, cols + QUARTER, V, inv_t, b1, NOISY)
        best_val, best_col = _scan_quarter(best_val, best_col, row_start, cols + 2 * QUARTER, V, inv_t, b2, NOISY)
        best_val, best_col = _scan_quarter(best_val, best_col, row_start, cols + 3 * QUARTER, V, inv_t, b3, NOISY)
    best = tl.max(best_val, axis=0)
    return best, tl.min(tl.where(best_val == best, best_col, NO_TOKEN), axis=0)


@triton.jit(do_not_specialize=["tiles_per_split"])  # varies with the batch size: one variant for all
def _gumbel_sample_split_kernel(Logits, stride_row, Temps, Rng, BestVal, BestCol, V, tiles_per_split,
                                QUARTER: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    row_start = Logits + row.to(tl.int64) * stride_row
    first_tile = split * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, tl.cdiv(V, 4 * QUARTER))
    temp = tl.load(Temps + row).to(tl.float32)
    lanes = tl.arange(0, QUARTER)
    if temp > 0:
        seed = tl.load(Rng)
        step = tl.load(Rng + 1)
        zero = (lanes * 0).to(tl.uint32)
        best, col = _scan_tiles(row_start, first_tile, last_tile, V, tl.math.div_rn(1.0, temp), seed,
                                zero + row.to(tl.uint32), zero + (step & 0xFFFFFFFF).to(tl.uint32),
                                zero + (step >> 32).to(tl.uint32), lanes, QUARTER, True)
    else:
        best, col = _scan_tiles(row_start, first_tile, last_tile, V, 1.0, 0, lanes, lanes, lanes, lanes,
                                QUARTER, False)
    tl.store(BestVal + row * splits + split, best)
    tl.store(BestCol + row * splits + split, col)


@triton.jit(do_not_specialize=["splits"])  # varies with the batch size: one variant for every size of a power of 2
def _gumbel_sample_row_kernel(BestVal, BestCol, Out, Rng, splits, V, SPLITS: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, SPLITS)
    mask = offs < splits
    vals = tl.load(BestVal + row * splits + offs, mask=mask, other=float("-inf"))
    cols = tl.load(BestCol + row * splits + offs, mask=mask, other=NO_TOKEN)
    best = tl.max(vals, axis=0)
    col = tl.min(tl.where(vals == best, cols, NO_TOKEN), axis=0)
    tl.store(Out + row, tl.where(col < V, col, 0).to(tl.int64))
    if row == 0:
        tl.store(Rng + 1, tl.load(Rng + 1) + 1)


def split_plan(rows: int, vocab: int, tile: int) -> tuple[int, int]:
    """(splits, tiles per split): enough programs to fill the GPU for small batches, whole tiles per split."""
    tiles = triton.cdiv(vocab, tile)
    wanted = max(1, min(tiles, triton.cdiv(TARGET_PROGRAMS, rows)))
    per_split = triton.cdiv(tiles, wanted)
    return triton.cdiv(tiles, per_split), per_split


def gumbel_max_sample(logits: torch.Tensor, temperatures: torch.Tensor, rng: torch.Tensor, quarter: int
                      ) -> torch.Tensor:
    """`sampling.gumbel_max_sample` on CUDA; `quarter`: the stream's quarter tile (`sampling.GUMBEL_QUARTER`)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    splits, per_split = split_plan(rows, vocab, 4 * quarter)
    best_val = torch.empty(rows * splits, dtype=torch.float32, device=logits.device)
    best_col = torch.empty(rows * splits, dtype=torch.int32, device=logits.device)
    # no FMA contraction: logits * (1 / T) and the noise round as the torch reference does
    _gumbel_sample_split_kernel[(rows, splits)](
        logits, logits.stride(0), temperatures, rng, best_val, best_col, vocab, per_split,
        QUARTER=quarter, num_warps=4, enable_fp_fusion=False,
    )
    _gumbel_sample_row_kernel[(rows,)](best_val, best_col, out, rng, splits, vocab,
                                       SPLITS=triton.next_power_of_2(splits), num_warps=1)
    return out
