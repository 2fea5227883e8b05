"""The per-token FP8 quantization kernel gives the bytes and scales of the torch ops (`quantize_tokens_torch`):
dynamic and static scales, bf16 and fp32 rows, values rounding up into the next power of two, negative values
rounding to -0, all-zero rows, strided rows (CPU interpreter and GPU)."""

from __future__ import annotations

import pytest
import torch

from pdserve.quantization.fp8 import FP8_MAX, quantize_tokens, quantize_tokens_torch, quantize_tokens_triton


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [None, 0.01])
def test_kernel_matches_torch_interpreted(interpreted, dtype, static):
    wide = torch.zeros(12, 320, dtype=dtype)
    wide[:, :300] = rows().to(dtype)
    x = wide[:, :300]  # rows 320 apart
    scale = None if static is None else torch.tensor(static)
    assert_same(quantize_tokens_triton(x, scale), quantize_tokens_torch(x, scale))
    q, _ = quantize_tokens_triton(x, scale)
    assert (q.view(torch.uint8) == 0x80).any()  # some negative values rounded to -0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_torch_on_cuda(dtype):
    x = rows("cuda").to(dtype)
    for scale in (None, torch.tensor(0.01, device="cuda")):
        assert_same(quantize_tokens(x, scale), quantize_tokens_torch(x, scale))
