"""The few-rows linear kernel: same function as F.linear for any shape (CPU interpreter and GPU), every output
written, and `linear` routing only the shapes the tuner chose."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged_attention_reference import rel_err
from pdserve.kernels import skinny


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("n, k", [(40, 256), (64, 200)])  # a partial column block; a partial K block
def test_skinny_linear_matches_f_linear_interpreted(interpreted, rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    for cfg in (skinny.SkinnyConfig(16, 64, 4, 1), skinny.SkinnyConfig(32, 128, 4, 1)):
        for b in (None, bias):
            out = skinny.skinny_linear(x, w, b, cfg)
            assert out.shape == (rows, n) and torch.isfinite(out).all()
            assert rel_err(out, F.linear(x, w, b)) < 1e-5


def test_tuner_weights_come_from_memory(monkeypatch):
    """The tuner cycles through copies of a weight that fits L2, enough that each call's weight was evicted since
    its last use (2 x L2 of other copies in between); a weight over 2 x L2 is timed on itself."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("Props", (), {"L2_cache_size": 1000}))
    w = torch.randn(5, 15)  # 300 bytes: itself and ceil(2000 / 300) = 7 copies
    weight = skinny.cold_weights(w)
    turn = [weight() for _ in range(9)]
    assert turn[0] is w and turn[8] is w and len({id(t) for t in turn[:8]}) == 8
    assert all(torch.equal(t, w) for t in turn)
    big = torch.randn(2, 251)  # 2008 bytes
    weight = skinny.cold_weights(big)
    assert weight() is big and weight() is big


def test_linear_routes_only_tuned_shapes(monkeypatch):
    x, w = torch.randn(2, 32), torch.randn(48, 32)
    calls = []
    monkeypatch.setattr(skinny, "skinny_linear", lambda *a: calls.append(a) or F.linear(*a[:3]))
    monkeypatch.setitem(skinny._choice, (2, 48, 32, torch.float32), skinny.CANDIDATES[0])
    assert torch.equal(skinny.linear(x, w), F.linear(x, w))
    assert calls == []  # CPU tensors always take F.linear


@pytest.mark.gpu
def test_skinny_linear_on_gpu_and_tuner_choice():  # skipped without CUDA by the `gpu` mark (tests/conftest.py)
    w = torch.randn(4096 + 48, 1024, device="cuda", dtype=torch.bfloat16)
    report = skinny.SkinnyTuner([1, 4, 16, 17]).tune([w])
    assert set(report) == {(m, w.shape[0], 1024) for m in (1, 4, 16)}  # 17 rows is above MAX_ROWS
    for rows in (1, 4, 16):
        x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x.float(), w.float())
        for cfg in skinny.CANDIDATES:
            out = skinny.skinny_linear(x, w, None, cfg)
            assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-2
        assert rel_err(skinny.linear(x, w), ref) < 1e-2
