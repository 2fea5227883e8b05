"""One FP8 rows candidate of each kind, for GPU tests whose point is not the choice among them: every candidate
compiles (on a cold Triton cache, seconds each), so checking or tuning all of them belongs to `-m tuner_sweep`."""

from __future__ import annotations

from pdserve.quantization import fp8

ROW_SHAPE_CANDIDATES = fp8.FP8_CANDIDATES[: 2 * len(fp8._ROW_SHAPES)]  # the fused epilogues' block shapes
EVERY_CANDIDATE = fp8.fp8_candidates  # the unrestricted function, where a test patches it


def one_candidate_of_each_kind(rows: int, configs=fp8.FP8_CANDIDATES) -> tuple[fp8.Fp8RowsConfig, ...]:
    """The first of `configs` that may run `rows` rows of each kind: quantizing in the kernel or not, split-K or not,
    a row block shape (SiLU-and-mul and rotary epilogues) or a batch one. Takes `fp8.fp8_candidates`'s arguments."""
    kinds = {}
    for cfg in EVERY_CANDIDATE(rows, configs):
        kinds.setdefault((cfg.quantize_in_kernel, cfg.split_k > 1, cfg in ROW_SHAPE_CANDIDATES), cfg)
    return tuple(kinds.values())
