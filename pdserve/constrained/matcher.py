"""One request's grammar state and the token bitmask it puts on the logits.

The bitmask of the constrained rows is filled on the CPU and applied to a float32 copy of the logits by xgrammar's
`apply_token_bitmask_inplace` (its CUDA kernel on a GPU, its CPU kernel elsewhere); rows without a grammar are left
as they are.
"""

from __future__ import annotations

from typing import Any

import torch

from pdserve.constrained.utf8_guard import BOUNDARY, Utf8Guard


class RequestGrammar:
    """The matcher of one request: which tokens may come next, and whether the grammar has ended."""

    __slots__ = ("matcher", "guard", "utf8_state")

    def __init__(self, compiled: Any, guard: Utf8Guard):
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.guard = guard
        self.utf8_state = BOUNDARY  # where the output's bytes so far leave the UTF-8 automaton

    def accept(self, token: int) -> bool:
        """Advance over `token`; False if the grammar does not allow it (the matcher is then unchanged)."""
        following = self.guard.advance(self.utf8_state, token)
        if following is None or not self.matcher.accept_token(token):
            return False
        self.utf8_state = following
        return True

    @property
    def terminated(self) -> bool:
        """The grammar accepted its end (a stop token): nothing more may follow."""
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        self.guard.restrict(bitmask[row], self.utf8_state)


def mask_logits(logits: torch.Tensor, grammars: list[RequestGrammar | None]) -> torch.Tensor:
    """A float32 copy of `logits` [B, V] where row i allows only the tokens grammars[i] allows next."""
    import xgrammar

    rows = [i for i, grammar in enumerate(grammars) if grammar is not None]
    masked = logits.to(torch.float32, copy=True)
    bitmask = xgrammar.allocate_token_bitmask(len(grammars), logits.shape[1])
    for i in rows:
        grammars[i].fill(bitmask, i)
    xgrammar.apply_token_bitmask_inplace(masked, bitmask.to(masked.device, non_blocking=True), indices=rows)
    return masked
