"""Warming L2 with the weight a decode step reads next: what a kernel is asked to prefetch (the Triton side is
`prefetch_share` in `pdserve.kernels.skinny_triton`). At a few rows a decode step is its weights
read once, and between two projections memory sits idle: the short kernels between them (RMSNorm, SiLU-and-mul)
read kilobytes, and every launch has its gap and its ramp. A projection kernel that, once its own weight is read,
asks L2 for the first bytes of the next projection's weight fills that idle time, and the next kernel finds them
there. Only a hint: `prefetch.global.L2` neither faults nor waits, and nothing depends on it but speed."""

from __future__ import annotations

import torch

DEFAULT_PREFETCH_BYTES = 24 << 20  # bytes of the next weight asked for at most: about half of an H100's 50 MB L2
_budget = DEFAULT_PREFETCH_BYTES


def set_prefetch_budget(num_bytes: int) -> None:
    """The bytes of the next weight a kernel asks for at most, for this process (0: none; --disable-weight-prefetch)."""
    global _budget
    _budget = num_bytes


def prefetch_target(weight: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
    """(the bytes of `weight` as uint8, how many of its first bytes to prefetch); (None, 0) for no weight or no
    budget."""
    if weight is None or _budget == 0:
        return None, 0
    flat = weight.view(torch.uint8)  # a contiguous weight's bytes, whatever its dtype
    return flat, min(flat.numel(), _budget)
