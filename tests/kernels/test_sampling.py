from __future__ import annotations

from functools import partial

import pytest
import torch

from pdserve.kernels import sample, top_k_top_p_min_p_candidates
from pdserve.kernels.sampling import GUMBEL_QUARTER, GUMBEL_TILE, gumbel_max_sample, gumbel_max_sample_ref

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


# ---- gumbel_max_sample: greedy and temperature-only rows ----------------------------------------------------------


def chi_square_p_value(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of the drawn tokens against the distribution `probs` (float64)."""
    observed = torch.bincount(tokens.cpu(), minlength=len(probs)).double()
    expected = probs.double().cpu() * len(tokens)
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(probs) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic / 2))


def draw_many(logits_row: torch.Tensor, temperature: float, draws: int, sampler, seed: int) -> torch.Tensor:
    """`draws` tokens from one row's distribution: one call, one batch row per draw (independent noise)."""
    logits = logits_row.expand(draws, -1).contiguous()
    temps = torch.full((draws,), temperature, device=logits.device)
    return sampler(logits, temps, torch.tensor([seed, 0], device=logits.device))


def special_rows(device, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that probe ties, NaN and -inf, each greedy and sampled: (logits [8, vocab], temperatures [8])."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, vocab, generator=gen) * 2
    logits[0:2, [5, vocab - 3, GUMBEL_TILE + 1]] = 50.0  # a three-way tie across tiles (and splits)
    logits[2:4, 7] = float("nan")  # NaN never wins
    logits[2:4, 9] = 40.0
    logits[4:6] = float("-inf")  # one finite logit: always drawn
    logits[4:6, vocab - 1] = -3.0
    logits[6:8] = float("nan")  # no finite score at all: token 0
    return logits.to(device), torch.tensor([0.0, 0.7] * 4, device=device)


def check_special_rows(sampler, device, vocab: int = GUMBEL_TILE + 700) -> None:
    logits, temps = special_rows(device, vocab)
    tokens = sampler(logits, temps, torch.tensor([11, 4], device=device)).tolist()
    assert tokens[0] == 5 and tokens[1] in (5, vocab - 3, GUMBEL_TILE + 1)
    assert tokens[2] == 9 and tokens[3] != 7
    assert tokens[4:6] == [vocab - 1] * 2 and tokens[6:8] == [0, 0]


def test_gumbel_reference_greedy_is_argmax_and_draws_follow_softmax():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 3000, generator=gen) * 3
    logits[:, 100] = logits[:, 2900] = 30.0  # ties: the lowest column
    rng = torch.tensor([0, 0])
    assert torch.equal(gumbel_max_sample_ref(logits, torch.zeros(64), rng), torch.full((64,), 100))
    assert rng.tolist() == [0, 1]  # the step advanced, the seed did not

    row = torch.linspace(-2.0, 2.0, 12)
    tokens = draw_many(row, 0.6, 20000, gumbel_max_sample_ref, seed=42)
    assert chi_square_p_value(tokens, (row / 0.6).softmax(-1)) > 1e-3
    check_special_rows(gumbel_max_sample_ref, "cpu")


def test_gumbel_reference_is_reproducible_per_seed_and_step():
    logits = torch.randn(16, 500, generator=torch.Generator().manual_seed(6))
    temps = torch.full((16,), 1.0)
    draw = lambda seed, step: gumbel_max_sample_ref(logits, temps, torch.tensor([seed, step])).tolist()  # noqa: E731
    assert draw(1, 0) == draw(1, 0)
    assert draw(1, 0) != draw(1, 1) and draw(1, 0) != draw(2, 0)
    rng = torch.tensor([1, 0])
    assert [gumbel_max_sample_ref(logits, temps, rng).tolist() for _ in range(2)] == [draw(1, 0), draw(1, 1)]


@pytest.fixture
def interpreted_gumbel(interpreted):
    """The Triton kernels of `gumbel_max_sample`, run by Triton's interpreter."""
    from pdserve.kernels import gumbel_sampling

    return partial(gumbel_sampling.gumbel_max_sample, quarter=GUMBEL_QUARTER)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gumbel_kernel_interpreted_matches_reference(interpreted_gumbel, monkeypatch, dtype):
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(6, 2 * GUMBEL_TILE + 300, generator=gen) * 3).to(dtype)
    temps = torch.tensor([0.0, 1.0, 0.6, -1.0, 2.0, 0.05])
    expect = gumbel_max_sample_ref(logits, temps, torch.tensor([12345, 7]))
    for programs in (1, 10_000):  # one split per row, one tile per split: the same tokens
        monkeypatch.setattr("pdserve.kernels.gumbel_sampling.TARGET_PROGRAMS", programs)
        rng = torch.tensor([12345, 7])
        assert torch.equal(interpreted_gumbel(logits, temps, rng), expect)
        assert rng.tolist() == [12345, 8]
    check_special_rows(interpreted_gumbel, "cpu")


def test_gumbel_kernel_interpreted_draws_follow_softmax(interpreted_gumbel):
    row = torch.linspace(-1.5, 1.5, 8)
    tokens = draw_many(row, 0.7, 512, interpreted_gumbel, seed=9)
    assert chi_square_p_value(tokens, (row / 0.7).softmax(-1)) > 1e-3
    assert torch.equal(tokens, draw_many(row, 0.7, 512, gumbel_max_sample_ref, seed=9))


@pytest.mark.gpu
def test_gumbel_kernel_cuda_matches_reference_and_softmax():
    gen = torch.Generator().manual_seed(8)
    logits = (torch.randn(256, 151936, generator=gen) * 4).to(torch.bfloat16).cuda()
    temps = torch.rand(256, generator=gen).cuda()
    temps[::4] = 0.0
    rng = torch.tensor([5, 0], device="cuda")
    tokens = gumbel_max_sample(logits, temps, rng)
    expect = gumbel_max_sample_ref(logits, temps, torch.tensor([5, 0], device="cuda"))
    assert rng.tolist() == [5, 1]
    assert torch.equal(tokens[::4], logits[::4].argmax(-1))
    assert (tokens == expect).float().mean() > 0.99  # equal up to one-ulp log differences in near ties
    row = torch.linspace(-2.0, 2.0, 40, device="cuda")
    drawn = draw_many(row.to(torch.bfloat16), 0.8, 100_000, gumbel_max_sample, seed=1)
    assert chi_square_p_value(drawn, (row.to(torch.bfloat16).float() / 0.8).softmax(-1)) > 1e-3
    check_special_rows(gumbel_max_sample, "cuda")


@pytest.mark.gpu
def test_gumbel_kernel_cuda_graph_replays_the_eager_draws():
    logits = torch.randn(8, 151936, device="cuda").to(torch.bfloat16)
    temps = torch.tensor([0.0, 0.6, 1.0, 0.6, 0.0, 1.5, 0.9, 0.3], device="cuda")
    rng = torch.tensor([77, 0], device="cuda")
    gumbel_max_sample(logits, temps, rng)  # compile outside the capture
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=stream):
        graphed = gumbel_max_sample(logits, temps, rng)
    eager_rng = torch.tensor([77, 5], device="cuda")
    rng.copy_(eager_rng)
    for _ in range(3):
        graph.replay()
        assert torch.equal(graphed, gumbel_max_sample(logits, temps, eager_rng))
    assert rng.tolist() == eager_rng.tolist() == [77, 8]
