"""Sampling: batched top-k / top-p / min-p / temperature without sorting the vocabulary (torch ops), and
`gumbel_max_sample` for the rows that filter nothing (Triton on CUDA, its torch reference elsewhere).

Filters follow the sort-based reference semantics (as in SGLang's torch sampler): with the probabilities
p = softmax(logits / T) ranked in descending order, rank r survives iff r < top_k and the mass strictly
ahead of it is <= top_p and p_r >= min_p * p_0; survivors are renormalised and one token is drawn.
Instead of a full sort, the ranking is taken over the `max_top_k` most probable tokens (torch.topk):
exact whenever the surviving set fits in them, i.e. top_k <= max_top_k, or the top-p / min-p cut
falls inside them. Rows with no filter at all sample from the full softmax (exact) by an exponential race.

`gumbel_max_sample` serves the common rows, greedy or temperature without any filter, in one read of the logits in
their own dtype (bf16 on a GPU) and no [B, V] intermediate: token = argmax(logits / T + G) with G standard Gumbel
noise (the log-space form of the exponential race, so no softmax is needed), argmax(logits) where T <= 0. The noise
is counter-based, so a CUDA graph can replay it: `rng` is an int64 device tensor [seed, step]; G of row r, column j
comes from Philox4x32-10 keyed by the seed with the counter (j's lane in its tile, r, step), 23 random bits per
value; each call advances step by one on the device. Ties go to the lowest column; NaN logits never win; a row
with no finite score gives token 0. The Triton kernels (`gumbel_sampling.py`) and the torch reference here compute
the same stream and the same scores in the same float32 operations, so they agree token for token up to one-ulp
differences of the log functions.
"""

from __future__ import annotations

import torch

from pdserve.kernels.ops import HAS_TRITON

GUMBEL_QUARTER = 1024  # one Philox call yields four values: for the columns lane, lane + Q, lane + 2Q, lane + 3Q
GUMBEL_TILE = 4 * GUMBEL_QUARTER  # columns per tile; counter of (tile, lane) = tile * GUMBEL_QUARTER + lane
_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)
_PHILOX_KEY_STEP = (0x9E3779B9, 0xBB67AE85)
_U32 = 0xFFFFFFFF


def _exponential_race(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Index drawn with probability proportional to `weights` (>= 0, row sums > 0): argmax(w / Exp(1))."""
    noise = torch.empty_like(weights).exponential_(generator=generator).clamp_min_(1e-20)
    return (weights / noise).argmax(dim=-1)


def top_k_top_p_min_p_candidates(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor, max_top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [B, K], token_ids [B, K]) with K = min(max_top_k, V): the K most probable tokens of each row,
    weights = their probabilities where they survive the filters, else 0. Not renormalised.

    probs: [B, V] fp32 rows summing to 1; top_ks: [B] int (<= 0 means no limit); top_ps, min_ps: [B] float.
    """
    k = min(max_top_k, probs.shape[-1])
    top_probs, token_ids = probs.topk(k, dim=-1, sorted=True)
    mass_ahead = top_probs.cumsum(dim=-1) - top_probs
    ranks = torch.arange(k, device=probs.device)
    limit = torch.where(top_ks > 0, top_ks, k)
    keep = (ranks[None, :] < limit[:, None]) & (mass_ahead <= top_ps[:, None])
    keep &= top_probs >= top_probs[:, :1] * min_ps[:, None]
    keep[:, 0] = True
    return top_probs * keep, token_ids


def sample(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
    min_ps: torch.Tensor, *, max_top_k: int = 1024, generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token id per row: [B] int64. No host sync, fixed shapes (CUDA-graph safe with a fixed generator).

    logits: [B, V] any float dtype (not modified); temperatures: [B] float, <= 0 means greedy (argmax of
    logits); top_ks: [B] int, <= 0 or >= V means no top-k; top_ps: [B] float in (0, 1], 1 means off;
    min_ps: [B] float in [0, 1], 0 means off. See the module docstring for the exact filter semantics.
    A batch without any filtered row is served faster by `gumbel_max_sample`.
    """
    vocab = logits.shape[-1]
    greedy = temperatures <= 0
    scaled = logits.float() / torch.where(greedy, 1.0, temperatures.float())[:, None]
    probs = scaled.softmax(dim=-1)
    drawn = _exponential_race(probs, generator)
    filtered = ((top_ks > 0) & (top_ks < vocab)) | (top_ps < 1) | (min_ps > 0)
    weights, token_ids = top_k_top_p_min_p_candidates(probs, top_ks, top_ps.float(), min_ps.float(), max_top_k)
    from_candidates = token_ids.gather(1, _exponential_race(weights, generator)[:, None]).squeeze(1)
    drawn = torch.where(filtered, from_candidates, drawn)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)


def _mul_u32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32 bits of a * b for a < 2**32 and int64 b < 2**32, through 16-bit halves (no int64 overflow)."""
    low_half = b * (a & 0xFFFF)
    upper = b * (a >> 16) + (low_half >> 16)
    return upper >> 16, ((upper & 0xFFFF) << 16) | (low_half & 0xFFFF)


def philox4x32(seed: int, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor
               ) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 as Triton's `tl.random.philox` computes it; uint32 values held in int64 tensors."""
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    for _ in range(10):
        hi_b, lo_b = _mul_u32(_PHILOX_ROUND[1], c2)
        hi_a, lo_a = _mul_u32(_PHILOX_ROUND[0], c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY_STEP[0]) & _U32, (k1 + _PHILOX_KEY_STEP[1]) & _U32
    return c0, c1, c2, c3


def gumbel_noise(seed: int, step: int, rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """The float32 Gumbel noise [len(rows), vocab] that `gumbel_max_sample` adds to these batch rows at this step."""
    tiles = -(-vocab // GUMBEL_TILE)
    lanes = min(vocab, GUMBEL_QUARTER)  # fewer than a quarter only for a vocabulary inside it: column = lane
    counters = (torch.arange(tiles, device=rows.device)[:, None] * GUMBEL_QUARTER
                + torch.arange(lanes, device=rows.device)).view(-1)
    shape = (len(rows), len(counters))
    bits = philox4x32(seed, counters.expand(shape), rows[:, None].expand(shape),
                      torch.full(shape, step & _U32, device=rows.device),
                      torch.full(shape, (step >> 32) & _U32, device=rows.device))
    columns = torch.stack([b.view(len(rows), tiles, lanes) for b in bits], dim=2).view(len(rows), -1)
    u = ((columns[:, :vocab] >> 9).float() + 0.5) * 2.0**-23
    return -torch.log(-torch.log(u))


def gumbel_max_sample_ref(logits: torch.Tensor, temperatures: torch.Tensor, rng: torch.Tensor) -> torch.Tensor:
    """The torch reference of `gumbel_max_sample` (reads `rng` on the host)."""
    seed, step = rng.tolist()
    scores = logits.float()
    sampled = (temperatures > 0).nonzero().squeeze(1)
    if len(sampled):
        inv_t = 1.0 / temperatures[sampled].float()
        noisy = scores[sampled] * inv_t[:, None] + gumbel_noise(seed, step, sampled, logits.shape[1])
        scores = scores.index_put((sampled,), noisy)
    rng[1:].add_(1)
    return scores.masked_fill(scores.isnan(), float("-inf")).argmax(dim=-1)


def gumbel_max_sample(logits: torch.Tensor, temperatures: torch.Tensor, rng: torch.Tensor) -> torch.Tensor:
    """One token id per row, [B] int64, for rows without top-k / top-p / min-p (see the module docstring).

    logits: [B, V] any float dtype, rows contiguous (not modified); temperatures: [B] float32, <= 0 means greedy;
    rng: int64 [2] (seed, step) on the logits' device, advanced by one. On CUDA (Triton): no host sync, CUDA-graph safe.
    """
    if HAS_TRITON and logits.is_cuda:
        from pdserve.kernels import gumbel_sampling

        return gumbel_sampling.gumbel_max_sample(logits, temperatures, rng, GUMBEL_QUARTER)
    return gumbel_max_sample_ref(logits, temperatures, rng)
