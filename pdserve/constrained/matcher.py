"""One request's grammar state and the token bitmask a batch puts on its logits.

The bitmask lives in buffers kept across steps (`TokenBitmask`): filled on the CPU (pinned memory on a GPU), copied
to the device in one transfer and applied to a float32 copy of the logits by xgrammar's `apply_token_bitmask_inplace`
(its Triton kernel on a GPU, its CPU kernel elsewhere) over every row at once: a row without a grammar allows every
token, so no row indices are uploaded, and the kernel's variants depend on the batch size alone (== 1, a multiple
of 16, other), which the warm-up reaches.
"""

from __future__ import annotations

from typing import Any

import torch

from pdserve.constrained.utf8_guard import BOUNDARY, UNRESTRICTED, Utf8Guard


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


def fill_bitmask(bitmask: torch.Tensor, grammars: list[RequestGrammar | None]) -> None:
    """Row i of `bitmask` [B, W]: the tokens grammars[i] allows next, every token where it is None."""
    states, guard = [], None
    for i, grammar in enumerate(grammars):
        if grammar is None:
            bitmask[i].fill_(-1)
            states.append(UNRESTRICTED)
        else:
            grammar.matcher.fill_next_token_bitmask(bitmask, i)
            states.append(grammar.utf8_state)
            guard = grammar.guard  # one per vocabulary: every grammar of a server has the same
    if guard is not None:
        guard.restrict(bitmask, states)


class TokenBitmask:
    """The bitmask buffers of one scheduler: `host` [rows, W] int32 and its device copy (the same tensor on a CPU),
    sized for `max_rows` and grown if a batch is larger."""

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self.host: torch.Tensor | None = None
        self.on_device: torch.Tensor | None = None
        self.copied: torch.cuda.Event | None = None  # recorded after the last copy from `host`

    def mask(self, logits: torch.Tensor, grammars: list[RequestGrammar | None]) -> torch.Tensor:
        """A float32 copy of `logits` [B, V] where row i allows only the tokens grammars[i] allows next."""
        import xgrammar

        host = self._host_rows(len(grammars), logits)
        fill_bitmask(host, grammars)
        masked = logits.to(torch.float32, copy=True)
        xgrammar.apply_token_bitmask_inplace(masked, self._to_device(host))
        return masked

    def _host_rows(self, rows: int, logits: torch.Tensor) -> torch.Tensor:
        if self.host is None or rows > self.host.shape[0]:
            self._allocate(max(rows, self.max_rows), -(-logits.shape[1] // 32), logits.device)
        elif self.copied is not None:
            self.copied.synchronize()  # the last copy has read the buffer (by now it has: its step was read back)
        return self.host[:rows]

    def _allocate(self, rows: int, words: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.empty(rows, words, dtype=torch.int32, pin_memory=cuda)
        self.on_device = torch.empty_like(self.host, device=device) if cuda else self.host
        self.copied = torch.cuda.Event() if cuda else None

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        if self.copied is None:
            return host
        rows = self.on_device[: host.shape[0]]
        rows.copy_(host, non_blocking=True)
        self.copied.record()
        return rows
