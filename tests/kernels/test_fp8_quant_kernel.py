"""Every kernel that quantizes rows per token for an FP8 layer (`quantize_tokens`, and the RMSNorm and SiLU-and-mul
kernels handing their output over as `Fp8Rows`) gives the bytes and scales of the torch ops: dynamic and static
scales, bf16 and fp32 rows, values rounding up into the next power of two, negative values rounding to -0, all-zero
rows, strided rows (CPU interpreter and GPU)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import fused, rmsnorm, rmsnorm_ref, silu_and_mul, silu_and_mul_ref
from pdserve.kernels.fp8_rows import FP8_MAX, Fp8Output, quantize_tokens_ref
from pdserve.quantization.fp8 import quantize_tokens


def rows(device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 300, generator=gen) * torch.logspace(-4, 4, 12)[:, None]
    x[2] = 0.0
    x[3] = torch.rand(300, generator=gen)
    x[3, :4] = torch.tensor([FP8_MAX, 15.9, -31.9, -1e-5])  # scale 1: 15.9 -> 16, -31.9 -> -32, -1e-5 -> -0
    return x.to(device)


def assert_same(got, expected):
    assert torch.equal(got[1], expected[1])
    assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8))


def assert_close(got, expected):
    """Quantized rows one rounding apart: scales within a float32 ulp, values within one E4M3 step."""
    torch.testing.assert_close(got[1], expected[1], rtol=2**-22, atol=0)
    torch.testing.assert_close(got[0].float() * got[1], expected[0].float() * expected[1],
                               rtol=2**-3, atol=2**-9 * expected[1].max().item())


def assert_kernels_quantize_like_torch(x: torch.Tensor, scale: torch.Tensor | None) -> None:
    """The Triton kernels (`pdserve.kernels.fused`, as the CUDA path runs them): quantizing in the RMSNorm and
    SiLU-and-mul kernels gives the bytes of `quantize_tokens` applied to what they write unquantized — exactly for
    16-bit rows (what models run); float32 rows have no rounding after the norm to hide the compiler's freedom in the
    two kernel variants (a fused multiply-add in one), so there the rows may be one rounding apart."""
    same = assert_same if x.dtype != torch.float32 or not x.is_cuda else assert_close
    fp8 = Fp8Output(scale)
    assert_same(fused.quantize_tokens(x, fp8), quantize_tokens_ref(x, scale))
    weight = torch.linspace(0.5, 2.0, x.shape[1], device=x.device).to(x.dtype)
    residual = rows(x.device.type).flip(0).to(x.dtype)
    normed, new_residual = fused.rmsnorm(x, weight, 1e-6, residual, fp8)
    normed_plain, new_residual_plain = fused.rmsnorm(x, weight, 1e-6, residual)
    same(normed, quantize_tokens_ref(normed_plain, scale))
    assert torch.equal(new_residual, new_residual_plain)
    same(fused.rmsnorm(x, weight, 1e-6, fp8=fp8), quantize_tokens_ref(fused.rmsnorm(x, weight, 1e-6), scale))
    gate_up = torch.cat([x, residual], dim=1)
    same(fused.silu_and_mul(gate_up, fp8), quantize_tokens_ref(fused.silu_and_mul(gate_up), scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [None, 0.01])
def test_kernels_match_torch_interpreted(interpreted, dtype, static):
    wide = torch.zeros(12, 320, dtype=dtype)
    wide[:, :300] = rows().to(dtype)
    x = wide[:, :300]  # rows 320 apart
    scale = None if static is None else torch.tensor(static)
    assert_kernels_quantize_like_torch(x, scale)
    q, _ = fused.quantize_tokens(x, Fp8Output(scale))
    assert (q.view(torch.uint8) == 0x80).any()  # some negative values rounded to -0


@pytest.mark.parametrize("static", [None, 0.01])
def test_torch_path_hands_over_the_same_rows(static):
    """Without a GPU the ops quantize the torch results: `Fp8Rows` of the same bytes, in the rows' dtype."""
    x = rows().to(torch.bfloat16)
    scale = None if static is None else torch.tensor(static)
    weight = torch.linspace(0.5, 2.0, x.shape[1]).to(x.dtype)
    normed = rmsnorm(x, weight, 1e-6, fp8=Fp8Output(scale))
    assert normed.dtype == torch.bfloat16 and normed.shape == x.shape
    assert_same((normed.values, normed.scale), quantize_tokens_ref(rmsnorm_ref(x, weight, 1e-6), scale))
    activated = silu_and_mul(torch.cat([x, x], dim=1), Fp8Output(scale))
    assert_same((activated.values, activated.scale), quantize_tokens_ref(silu_and_mul_ref(torch.cat([x, x], 1)), scale))
    assert_same(quantize_tokens(x, scale), quantize_tokens_ref(x, scale))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernels_match_torch_on_cuda(dtype):
    x = rows("cuda").to(dtype)
    for scale in (None, torch.tensor(0.01, device="cuda")):
        assert_kernels_quantize_like_torch(x, scale)
        weight = torch.ones(x.shape[1], device="cuda", dtype=dtype)
        normed = rmsnorm(x, weight, 1e-6, fp8=Fp8Output(scale))  # through the dispatcher, as the model calls it
        same = assert_same if dtype != torch.float32 else assert_close
        same((normed.values, normed.scale), quantize_tokens_ref(rmsnorm(x, weight, 1e-6), scale))
