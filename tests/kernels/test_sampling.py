from __future__ import annotations

import pytest
import torch

from pdserve.kernels import sample, top_k_top_p_min_p_candidates

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def sorted_reference(probs, top_ks, top_ps, min_ps):
    """Full-sort reference (SGLang torch sampler semantics): renormalised [B, V] distribution."""
    sorted_probs, idx = probs.sort(dim=-1, descending=True)
    ahead = sorted_probs.cumsum(-1) - sorted_probs
    ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    limit = torch.where(top_ks > 0, top_ks, probs.shape[-1])[:, None]
    keep = (ahead <= top_ps[:, None]) & (ranks < limit) & (sorted_probs >= sorted_probs[:, :1] * min_ps[:, None])
    kept = torch.zeros_like(probs).scatter(1, idx, sorted_probs * keep)
    return kept / kept.sum(-1, keepdim=True)


@pytest.mark.parametrize("device", DEVICES)
def test_candidates_match_full_sort(device):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 10000, generator=gen) * 3).to(device)
    probs = logits.softmax(-1)
    top_ks = torch.tensor([0, 1, 20, 0, 50, 7], device=device)
    top_ps = torch.tensor([1.0, 1.0, 0.9, 0.5, 0.3, 1.0], device=device)
    min_ps = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.0, 0.2], device=device)
    expect = sorted_reference(probs, top_ks, top_ps, min_ps)
    # exact with K = V; with K = 256 exact for rows whose survivors fit in the top 256 (not row 0)
    for max_top_k, rows in ((10000, slice(None)), (256, slice(1, None))):
        weights, ids = top_k_top_p_min_p_candidates(probs, top_ks, top_ps, min_ps, max_top_k=max_top_k)
        ours = torch.zeros_like(probs).scatter(1, ids, weights)
        ours = ours / ours.sum(-1, keepdim=True)
        torch.testing.assert_close(ours[rows], expect[rows], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_sample_greedy_support_and_frequencies(device):
    gen = torch.Generator(device=device).manual_seed(1)
    vocab, draws = 50, 20000
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(2)).to(device)
    logits = base.expand(draws, vocab).clone()
    temps = torch.full((draws,), 0.7, device=device)
    top_ks = torch.full((draws,), 10, device=device)
    top_ps = torch.full((draws,), 0.95, device=device)
    min_ps = torch.zeros(draws, device=device)
    temps[:100] = 0.0  # greedy rows
    top_ks[100:10100], top_ps[100:10100] = 0, 1.0  # unfiltered rows: full-softmax path
    tokens = sample(logits, temps, top_ks, top_ps, min_ps, generator=gen)
    assert tokens.dtype == torch.int64 and tokens.shape == (draws,)
    assert (tokens[:100] == base.argmax()).all()
    probs = (base / 0.7).softmax(-1)
    for rows, expect in (
        (slice(100, 10100), probs),
        (slice(10100, None), sorted_reference(probs[None], top_ks[-1:], top_ps[-1:], min_ps[-1:])[0]),
    ):
        counts = torch.bincount(tokens[rows], minlength=vocab).double()
        freq = counts / counts.sum()
        assert (counts[expect == 0] == 0).all()
        assert (freq - expect.double()).abs().sum() < 0.05  # total variation * 2 of 10k draws
