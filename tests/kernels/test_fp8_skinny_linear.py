"""The skinny FP8 kernel (rows quantized in the kernel, FP8 weight streamed once) gives what quantize +
GEMM gives: the same quantized operands, float32 sums in another order (CPU interpreter and GPU); `fp8_linear`
routes few rows to it only where the tuner chose it."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import skinny
from pdserve.quantization import fp8


def operands(m: int, n: int, k: int, device: str = "cpu", dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, m)[:, None]
    if m > 2:
        x[1] = 0.0  # an all-zero row: the smallest scale
    w_q, w_scale = fp8.quantize_rows(torch.randn(n, k, generator=gen))
    bias = torch.randn(n, generator=gen)
    return x.to(device, dtype), w_q.to(device), w_scale.to(device), bias.to(device, dtype)


def assert_close_to_quantized_linear(x, w_q, w_scale, bias, cfg):
    """Against the float64 product of the same quantized operands (`torch._scaled_mm`, the GEMM of more rows, is
    no reference here: Hopper's FP8 MMA sums with fewer bits and rounds to bf16 before an fp16 output)."""
    for static in (None, torch.tensor(0.02, device=x.device)):
        x_q, x_scale = fp8.quantize_tokens_torch(x, static)
        exact = (x_q.double() * x_scale.double()) @ (w_q.double() * w_scale.double()[:, None]).t() + bias.double()
        got = fp8.skinny_fp8_linear(x, w_q, w_scale, static, bias, cfg).double()
        assert torch.equal(fp8.quantize_tokens(x, static)[0].view(torch.uint8), x_q.view(torch.uint8))
        tolerance = 1e-6 if x.dtype == torch.float32 else 4e-3  # float32 sums; the 16-bit output's rounding
        assert ((got - exact).norm(dim=1) <= tolerance * exact.norm(dim=1)).all(), (got - exact).abs().max()


@pytest.mark.parametrize("m, n, k", [(1, 48, 64), (3, 40, 96), (4, 64, 200)])
def test_skinny_fp8_matches_quantized_linear_interpreted(interpreted, m, n, k):
    x, w_q, w_scale, bias = operands(m, n, k)
    for cfg in (skinny.SkinnyConfig(16, 32, 4, 1), skinny.SkinnyConfig(32, 64, 4, 1)):
        assert_close_to_quantized_linear(x, w_q, w_scale, bias, cfg)


def test_fp8_linear_routes_few_rows_by_the_tuned_choice(monkeypatch):
    x, w_q, w_scale, _ = operands(3, 48, 32)
    calls = []
    monkeypatch.setattr(fp8, "skinny_fp8_linear", lambda *a: calls.append(a) or fp8.quantized_linear(*a[:5]))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # as on a GPU, computed on the CPU
    monkeypatch.setattr(fp8, "quantize_tokens", fp8.quantize_tokens_torch)
    monkeypatch.setattr(fp8, "has_fp8_gemm", lambda device: False)
    monkeypatch.setitem(skinny._choice, (3, 48, 32, fp8.FP8), fp8.FP8_CANDIDATES[0])
    assert torch.equal(fp8.fp8_linear(x, w_q, w_scale), fp8.quantized_linear(x, w_q, w_scale, None, None))
    assert len(calls) == 1 and calls[0][-1] == fp8.FP8_CANDIDATES[0]
    fp8.fp8_linear(torch.randn(4, 32), w_q, w_scale)  # 4 rows were not tuned: quantize + GEMM
    assert len(calls) == 1


@pytest.mark.fp8_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_skinny_fp8_on_gpu_and_tuner_choice(dtype):
    for m, n, k in ((1, 4096, 4096), (3, 6144, 4096), (4, 4096, 14336)):
        x, w_q, w_scale, bias = operands(m, n, k, "cuda", dtype)
        for cfg in fp8.FP8_CANDIDATES:
            assert_close_to_quantized_linear(x, w_q, w_scale, bias, cfg)
    report = fp8.tune_skinny_fp8([1, 4, 16], [(w_q, w_scale)], dtype)
    assert set(report) == {(1, 4096, 14336), (4, 4096, 14336)}  # more rows than FP8_MAX_ROWS are not tuned
    assert all(reference > 0 and best > 0 for reference, best in report.values())
