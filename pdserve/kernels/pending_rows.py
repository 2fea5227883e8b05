"""What a kernel hands an FP8 projection beside plain rows, so that the FP8 rows kernel does less before its weight
streams. `RowsWithAmax`: rows with each row's amax in parts, from the kernel that made them. `PendingNorm`: a decode
batch's RMSNorm rows handed to the FP8 projection after the norm (qkv_proj, gate_up_proj) before they
are computed. Where the tuner measured it faster (one or two rows), the FP8 rows kernel computes them itself as it
quantizes them, which saves the RMSNorm's own launch and its gap in the decode graph; anywhere else `evaluate` runs
the RMSNorm kernel first. Either way the same arithmetic: the rows kernel repeats the RMSNorm kernel's float32
math and roundings (`pdserve.kernels.fused`), its sum of squares in another order."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.fp8_rows import Fp8Output, Fp8Rows
from pdserve.kernels.ops import rmsnorm


@dataclass(frozen=True, slots=True)
class PendingNorm:
    """RMSNorm(hidden + residual) * weight, quantized per token for `fp8`'s layer; residual_out takes hidden +
    residual, written by whichever kernel evaluates the rows (the next layer's residual stream: nothing reads it
    before that)."""

    hidden: torch.Tensor
    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    fp8: Fp8Output
    residual_out: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.hidden.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.hidden.dtype

    def evaluate(self) -> Fp8Rows:
        rows, _ = rmsnorm(self.hidden, self.weight, self.eps, self.residual, self.fp8, self.residual_out)
        return rows


@dataclass(frozen=True, slots=True)
class RowsWithAmax:
    """Rows in the model dtype ([M, K]) and each row's amax in parts (amax_parts [M, P] float32: a row's amax is the
    max of its parts), written by the kernel that made the rows (the FP8 gate_up kernel computing SiLU(gate) * up,
    one part a program). The FP8 rows kernel quantizing them per token where the tuner chose it reads the parts
    instead of passing over each row for its amax (the same scales: a max is exact in any order); anything else
    takes the rows (`evaluate`)."""

    values: torch.Tensor
    amax_parts: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    def evaluate(self) -> torch.Tensor:
        return self.values
