"""FP8 numerics: per-token activation scales and per-channel weight scales computed by hand, the fallback GEMM
equals the dequantized product, and on a GPU (sm89+) `torch._scaled_mm` agrees with the fallback, also inside a
CUDA graph."""

from __future__ import annotations

import pytest
import torch

from pdserve.quantization.fp8 import (FP8, dequantized_mm, fp8_linear, has_fp8_gemm, quantize_rows, quantize_tokens,
                                      scaled_mm)
from pdserve.quantization.formats import dequantize_blocks, quantize_blocks


def test_activation_scales_are_per_token_amax_over_448():
    x = torch.tensor([[1.0, -2.0, 0.5, 4.0], [0.0, 0.0, 0.0, 0.0], [-896.0, 3.0, 1.0, 2.0]])
    q, scale = quantize_tokens(x)
    assert scale.shape == (3, 1) and scale.dtype == torch.float32
    assert scale[0, 0].item() == pytest.approx(4.0 / 448) and scale[2, 0].item() == 2.0
    assert scale[1, 0].item() == pytest.approx(1e-12)  # an all-zero token still has a scale
    # row 0: x / (4/448) = x * 112 -> 112, -224, 56, 448 are all exact E4M3 values
    assert q.float()[0].tolist() == [112.0, -224.0, 56.0, 448.0]
    assert q.float()[1].tolist() == [0.0] * 4
    # row 2: x / 2 -> -448, 1.5, 0.5, 1.0
    assert q.float()[2].tolist() == [-448.0, 1.5, 0.5, 1.0]
    # 3 / 2 = 1.5 exact; 1 / (4/448) * 1.03 rounds to the nearest E4M3 value (3 mantissa bits): 115.36 -> 112
    assert quantize_tokens(torch.tensor([[1.03, 4.0]]))[0].float()[0, 0].item() == 112.0


def test_a_static_scale_saturates_what_it_does_not_cover():
    q, scale = quantize_tokens(torch.tensor([[1.0, 100.0], [-40.0, 0.25]]), torch.tensor(0.125))
    assert scale.tolist() == [[0.125], [0.125]]
    assert q.float().tolist() == [[8.0, 448.0], [-320.0, 2.0]]  # 800 saturates at 448


def test_weight_scales_are_per_output_row():
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.5, -0.75]], dtype=torch.bfloat16)
    q, scale = quantize_rows(w)
    assert scale.dtype == torch.float32 and scale.tolist() == pytest.approx([1 / 448, 1e-12, 3 / 448])
    assert q.dtype == FP8 and q.float().tolist() == [[224.0, -448.0, 112.0], [0.0] * 3, [448.0, 224.0, -112.0]]


def test_the_fallback_gemm_is_the_dequantized_product():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32, generator=gen)
    w = torch.randn(24, 32, generator=gen)
    bias = torch.randn(24, generator=gen)
    w_q, w_scale = quantize_rows(w)
    out = fp8_linear(x.view(1, 5, 32), w_q, w_scale, None, bias)
    x_q, x_scale = quantize_tokens(x)
    expected = (x_q.double() * x_scale.double()) @ (w_q.double() * w_scale.double()[:, None]).t() + bias.double()
    assert out.shape == (1, 5, 24) and out.dtype == torch.float32
    torch.testing.assert_close(out[0].double(), expected, rtol=1e-5, atol=1e-5)
    # and close to the unquantized product: E4M3 keeps ~2 significant digits
    assert (out[0] - (x @ w.t() + bias)).abs().max() < 0.05 * (x @ w.t()).abs().max()


def test_block_scales_round_trip_ragged_blocks():
    w = torch.randn(200, 72, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_blocks(w, (128, 32))
    assert scale.shape == (2, 3)
    rows, cols = torch.arange(200) // 128, torch.arange(72) // 32
    assert torch.equal(dequantize_blocks(q, scale, (128, 32)), q.float() * scale[rows][:, cols])
    assert scale[1, 2].item() == pytest.approx(w[128:, 64:].abs().max().item() / 448)
    with pytest.raises(ValueError, match="do not tile"):
        dequantize_blocks(q, scale[:1], (128, 32))


def test_no_fp8_gemm_on_the_cpu():
    assert not has_fp8_gemm(torch.device("cpu"))


@pytest.mark.fp8_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaled_mm_matches_the_fallback_on_cuda(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m in (1, 7, 64, 300):
        x = torch.randn(m, 4096, device="cuda", dtype=dtype, generator=gen)
        w_q, w_scale = quantize_rows(torch.randn(1024, 4096, device="cuda", generator=gen) * 0.02)
        x_q, x_scale = quantize_tokens(x)
        fast = scaled_mm(x_q, x_scale, w_q, w_scale, dtype)
        reference = dequantized_mm(x_q, x_scale, w_q, w_scale, dtype)
        assert fast.dtype == dtype
        torch.testing.assert_close(fast, reference, rtol=1e-2, atol=1e-2 * reference.abs().max().item())


@pytest.mark.fp8_gpu
def test_fp8_linear_replays_in_a_cuda_graph():
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    w_q, w_scale = quantize_rows(torch.randn(256, 512, device="cuda"))
    eager = fp8_linear(x, w_q, w_scale)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fp8_linear(x, w_q, w_scale)  # warm-up on a side stream, as capture wants
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, w_q, w_scale)
    x.copy_(x * 2)
    graph.replay()
    torch.testing.assert_close(out, fp8_linear(x, w_q, w_scale))
    assert not torch.equal(out, eager)
