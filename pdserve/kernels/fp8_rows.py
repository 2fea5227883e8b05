"""Activation rows quantized per token to FP8 (E4M3) for an FP8 linear layer: the format's constants, the torch
reference, and what a kernel producing such rows is told (`Fp8Output`). The Triton kernels that write them (the
RMSNorm, SiLU-and-mul and quantize kernels of `pdserve.kernels.fused`) give the same bytes and scales."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# activation scales are amax * INV_FP8_MAX, the float32 reciprocal: torch on CUDA divides by a scalar that way, so
# the torch ops, the Triton kernels and every device give the same scale bits
INV_FP8_MAX = torch.tensor(1 / FP8_MAX, dtype=torch.float32).item()
MIN_SCALE = 1e-12  # an all-zero row (a padding row, a zero activation) still divides by something


@dataclass(frozen=True, slots=True)
class Fp8Rows:
    """Rows quantized per token: values [M, K] float8_e4m3fn, scale [M, 1] float32 (a row is values * scale);
    dtype: the rows' dtype before quantization, which the linear layer's output takes."""

    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


@dataclass(frozen=True, slots=True)
class Fp8Output:
    """A kernel's output quantized per row for a linear layer: with the layer's static input scale (a scalar
    tensor), or dynamic (None: each row's amax / FP8_MAX)."""

    static_scale: torch.Tensor | None = None

    def empty(self, rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty((rows, cols), dtype=FP8, device=device),
                torch.empty((rows, 1), dtype=torch.float32, device=device))

    def constants(self, device: torch.device) -> dict:
        """HW_CAST: round with the GPU's conversion (the interpreter's rounds some values wrongly)."""
        return dict(FP8_MAX=FP8_MAX, INV_FP8_MAX=INV_FP8_MAX, MIN_SCALE=MIN_SCALE, STATIC=self.static_scale is not None,
                    HW_CAST=device.type == "cuda")

    @staticmethod
    def constants_of(fp8: Fp8Output | None, device: torch.device) -> dict:
        """The kernel constants of `fp8`, or those of a launch that does not quantize."""
        return (fp8 or Fp8Output()).constants(device)


def to_fp8(values: torch.Tensor) -> torch.Tensor:
    """float32 values already divided by their scale -> float8, saturating at +-FP8_MAX (a static scale can
    leave values beyond it)."""
    return values.clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_tokens_ref(x: torch.Tensor, static_scale: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 [M, K], float32 scales [M, 1]): per token (amax / FP8_MAX), or the static scale."""
    if static_scale is None:
        scale = (x.abs().amax(dim=-1, keepdim=True).float() * INV_FP8_MAX).clamp(min=MIN_SCALE)
    else:
        scale = static_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return to_fp8(x.float() * torch.reciprocal(scale)), scale
