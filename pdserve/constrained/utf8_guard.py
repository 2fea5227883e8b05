"""Keeps constrained output valid UTF-8 where xgrammar does not: it accepts the three-byte encodings of UTF-16
surrogates (ED A0..BF xx, U+D800..U+DFFF), which are not UTF-8 and decode to three U+FFFD. A JSON string of
maxLength 8 could then come back 10 characters long.

The guard forbids every token whose bytes hold ED followed by A0..BF, and, right after a token that ends with the
lead byte ED, every token that starts with A0..BF. ED is always a lead byte in UTF-8, so looking one token back is
enough.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_SURROGATE_LEAD = 0xED
_SURROGATE_SECOND = range(0xA0, 0xC0)


class Utf8Guard:
    """The tokens of one vocabulary that would write a surrogate, as packed bitmask words (bit set = allowed)."""

    __slots__ = ("ends_with_lead", "never", "not_after_lead", "allowed_words", "allowed_after_lead_words")

    def __init__(self, token_bytes: Sequence[bytes]):
        self.never = frozenset(i for i, b in enumerate(token_bytes) if _holds_surrogate(b))
        self.not_after_lead = frozenset(i for i, b in enumerate(token_bytes) if b and b[0] in _SURROGATE_SECOND)
        self.ends_with_lead = frozenset(i for i, b in enumerate(token_bytes) if b and b[-1] == _SURROGATE_LEAD)
        self.allowed_words = _packed_allowed(len(token_bytes), self.never)
        self.allowed_after_lead_words = _packed_allowed(len(token_bytes), self.never | self.not_after_lead)

    def allows(self, token: int, after_lead: bool) -> bool:
        return token not in self.never and not (after_lead and token in self.not_after_lead)

    def restrict(self, bitmask_row: torch.Tensor, after_lead: bool) -> None:
        """Clear the forbidden tokens' bits in one row of an xgrammar bitmask (int32 words, bit j of word w is
        token 32w + j)."""
        words = self.allowed_after_lead_words if after_lead else self.allowed_words
        bitmask_row[:words.numel()] &= words


def _holds_surrogate(token: bytes) -> bool:
    return any(token[i] == _SURROGATE_LEAD and token[i + 1] in _SURROGATE_SECOND for i in range(len(token) - 1))


def _packed_allowed(vocab_size: int, forbidden: frozenset[int]) -> torch.Tensor:
    allowed = torch.ones(-(-vocab_size // 32) * 32, dtype=torch.int64)
    allowed[list(forbidden)] = 0
    words = (allowed.view(-1, 32) << torch.arange(32)).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
