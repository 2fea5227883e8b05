"""Fused ops vs their torch references: on CUDA (Triton path) and on CPU through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from paged_attention_reference import rel_err
from pdserve import kernels
from pdserve.kernels.ops import HAS_TRITON


def check_ops(device, dispatch, tokens=37, dtype=torch.bfloat16):
    """dispatch(name) -> the implementation under test; compares each with the torch reference."""
    gen = torch.Generator().manual_seed(tokens)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype).to(device)  # noqa: E731
    x, res, w = rnd(tokens, 1024), rnd(tokens, 1024), rnd(1024)
    out = dispatch("rmsnorm")(x, w, 1e-6)
    assert torch.equal(out, kernels.rmsnorm_ref(x, w, 1e-6)) or rel_err(out, kernels.rmsnorm_ref(x, w, 1e-6)) < 4e-3
    out, new_res = dispatch("rmsnorm")(x, w, 1e-6, residual=res)
    ref, ref_res = kernels.rmsnorm_ref(x, w, 1e-6, residual=res)
    assert torch.equal(new_res, ref_res) and rel_err(out, ref) < 4e-3

    qkv = rnd(tokens, 16 + 2 * 4, 128)  # per-head q/k norm on strided views of a fused qkv
    q_view, hw = qkv[:, :16], rnd(128)
    assert rel_err(dispatch("rmsnorm")(q_view, hw, 1e-6), kernels.rmsnorm_ref(q_view, hw, 1e-6)) < 4e-3

    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    cache = kernels.build_cos_sin_cache(inv_freq, 40000).to(device)
    positions = torch.randint(0, 40000, (tokens,), generator=gen).to(device)
    q_ref, k_ref = qkv[:, :16].clone(), qkv[:, 16:20].clone()
    kernels.apply_rotary_ref(positions, q_ref, k_ref, cache)
    untouched_v = qkv[:, 20:].clone()
    assert dispatch("apply_rotary")(positions, qkv[:, :16], qkv[:, 16:20], cache) is None
    assert rel_err(qkv[:, :16], q_ref) < 4e-3 and rel_err(qkv[:, 16:20], k_ref) < 4e-3
    assert torch.equal(qkv[:, 20:], untouched_v)

    gate_up = rnd(tokens, 2 * 3072)
    assert rel_err(dispatch("silu_and_mul")(gate_up), kernels.silu_and_mul_ref(gate_up)) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 37, 4096])
def test_fused_ops_cuda(tokens):
    assert HAS_TRITON
    check_ops("cuda", lambda name: getattr(kernels, name), tokens)


def test_fused_ops_cpu_fallback():
    check_ops("cpu", lambda name: getattr(kernels, name))


def test_fused_ops_triton_interpreter(interpreted):
    from pdserve.kernels import fused

    # fp32: Triton 3.6's interpreter rounds fp32 -> bf16 toward zero (seen 2026-11-21), the GPU does not
    check_ops("cpu", lambda name: getattr(fused, name), tokens=5, dtype=torch.float32)
