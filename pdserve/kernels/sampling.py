"""Batched top-k / top-p / min-p / temperature sampling without sorting the vocabulary (torch ops only).

Filters follow the sort-based reference semantics (as in SGLang's torch sampler): with the probabilities
p = softmax(logits / T) ranked in descending order, rank r survives iff r < top_k and the mass strictly
ahead of it is <= top_p and p_r >= min_p * p_0; survivors are renormalised and one token is drawn.
Instead of a full sort, the ranking is taken over the `max_top_k` most probable tokens (torch.topk):
exact whenever the surviving set fits in them, i.e. top_k <= max_top_k, or the top-p / min-p cut
falls inside them. Rows with no filter at all sample from the full softmax (exact) by an exponential race.
"""

from __future__ import annotations

import torch


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
    any_filter: bool = True,
) -> torch.Tensor:
    """One token id per row: [B] int64. No host sync, fixed shapes (CUDA-graph safe with a fixed generator).

    logits: [B, V] any float dtype (not modified); temperatures: [B] float, <= 0 means greedy (argmax of
    logits); top_ks: [B] int, <= 0 or >= V means no top-k; top_ps: [B] float in (0, 1], 1 means off;
    min_ps: [B] float in [0, 1], 0 means off. See the module docstring for the exact filter semantics.
    any_filter=False (the caller knows no row filters) skips the top-k candidate pass.
    """
    vocab = logits.shape[-1]
    greedy = temperatures <= 0
    scaled = logits.float() / torch.where(greedy, 1.0, temperatures.float())[:, None]
    probs = scaled.softmax(dim=-1)
    drawn = _exponential_race(probs, generator)
    if any_filter:
        filtered = ((top_ks > 0) & (top_ks < vocab)) | (top_ps < 1) | (min_ps > 0)
        weights, token_ids = top_k_top_p_min_p_candidates(probs, top_ks, top_ps.float(), min_ps.float(), max_top_k)
        from_candidates = token_ids.gather(1, _exponential_race(weights, generator)[:, None]).squeeze(1)
        drawn = torch.where(filtered, from_candidates, drawn)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)
