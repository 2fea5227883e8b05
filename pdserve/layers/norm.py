from __future__ import annotations

import torch
from torch import nn

from pdserve.kernels import rmsnorm
from pdserve.kernels.fp8_rows import Fp8Output
from pdserve.kernels.pending_rows import PendingNorm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, fp8: Fp8Output | None = None):
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual). fp8: norm(...) comes quantized
        for the FP8 layer after (`Fp8Rows`; see `pdserve.layers.linear.fp8_input`), and with a residual it comes
        pending (`PendingNorm`, x + residual a tensor that layer's kernel fills): that layer computes it."""
        if fp8 is None or residual is None:
            return rmsnorm(x, self.weight, self.eps, residual, fp8)
        residual_out = torch.empty_like(x)
        return PendingNorm(x, residual, self.weight, self.eps, fp8, residual_out), residual_out
