"""A decode batch's rows handed to an FP8 projection before they are computed: RMSNorm(x + residual) for qkv_proj
and gate_up_proj, SiLU(gate) * up for down_proj. Where the tuner measured it faster (a few rows), the FP8 rows kernel
computes them itself as it quantizes them, which saves the op's own launch and its gap in the decode graph; anywhere
else `evaluate` runs the op's own kernel first. Either way the same numbers: the kernel repeats the op's float32
arithmetic and roundings (`pdserve.kernels.fused`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.fp8_rows import Fp8Output, Fp8Rows
from pdserve.kernels.ops import rmsnorm, silu_and_mul

FP8_IN_KERNEL_ROWS = 8  # rows an FP8 rows kernel quantizes itself at most: from 9 rows on the op's kernel does


@dataclass(frozen=True, slots=True)
class PendingNorm:
    """RMSNorm(x + residual) * weight, quantized per token for `fp8`'s layer; residual_out takes x + residual, written
    by whichever kernel evaluates the rows (the residual stream of the next layer: nothing reads it before that)."""

    x: torch.Tensor
    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    fp8: Fp8Output
    residual_out: torch.Tensor

    kind = "rmsnorm"

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    def evaluate(self) -> Fp8Rows:
        rows, _ = rmsnorm(self.x, self.weight, self.eps, self.residual, self.fp8, self.residual_out)
        return rows

    def kernel_operands(self, unused: torch.Tensor) -> tuple:
        """(the first operand's rows, the second's, the norm weight, where x + residual goes, eps) for the FP8 rows
        kernel; `unused` fills what the op has not."""
        return self.x, self.residual, self.weight, self.residual_out, self.eps


@dataclass(frozen=True, slots=True)
class PendingSiluMul:
    """SiLU(gate) * up of gate_up [M, 2I] = cat(gate, up), for `fp8`'s layer: evaluated, the SiLU kernel quantizes
    them from FP8_IN_KERNEL_ROWS + 1 rows on; fewer come in the model dtype (the layer's kernel quantizes them)."""

    gate_up: torch.Tensor
    fp8: Fp8Output

    kind = "silu_mul"

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.gate_up.shape[0], self.gate_up.shape[1] // 2))

    @property
    def dtype(self) -> torch.dtype:
        return self.gate_up.dtype

    def evaluate(self) -> torch.Tensor | Fp8Rows:
        many = self.gate_up.shape[0] > FP8_IN_KERNEL_ROWS
        return silu_and_mul(self.gate_up, self.fp8 if many else None)

    def kernel_operands(self, unused: torch.Tensor) -> tuple:
        """As `PendingNorm.kernel_operands`: gate, up and nothing else."""
        inter = self.shape[1]
        return self.gate_up[:, :inter], self.gate_up[:, inter:], unused, unused, 0.0


PendingRows = PendingNorm | PendingSiluMul
