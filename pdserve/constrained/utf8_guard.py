"""Keeps constrained output valid UTF-8 where xgrammar 0.2.8 does not: inside a JSON string it accepts byte
sequences that are not UTF-8, such as the encodings of UTF-16 surrogates (ED A0..BF xx) and overlong forms
(E0 80..9F xx, F0 80..8F xx xx). Each decodes to several U+FFFD, so a string of maxLength 8 could come back 10
characters long.

The guard runs the UTF-8 automaton over the output bytes. Its state between two tokens is one of eight (on a
character boundary, or inside a character with the next byte's allowed range known), so for every state it
precomputes which tokens continue validly and where each leaves it; a step then costs one AND over the batch's
bitmask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BOUNDARY, CONT1, CONT2, CONT3, AFTER_E0, AFTER_ED, AFTER_F0, AFTER_F4 = range(8)
_NUM_STATES = 8
UNRESTRICTED = _NUM_STATES  # `restrict`'s state for a row it leaves as it is (a row without a grammar)
_INVALID = 255
# inside a character: the range of the next byte, and the state after it
_NEXT_BYTE = {CONT1: (0x80, 0xBF, BOUNDARY), CONT2: (0x80, 0xBF, CONT1), CONT3: (0x80, 0xBF, CONT2),
              AFTER_E0: (0xA0, 0xBF, CONT1), AFTER_ED: (0x80, 0x9F, CONT1),
              AFTER_F0: (0x90, 0xBF, CONT2), AFTER_F4: (0x80, 0x8F, CONT2)}


def _after_lead(byte: int) -> int:
    if byte < 0x80:
        return BOUNDARY
    if 0xC2 <= byte <= 0xDF:
        return CONT1
    special = {0xE0: AFTER_E0, 0xED: AFTER_ED, 0xF0: AFTER_F0, 0xF4: AFTER_F4}
    if byte in special:
        return special[byte]
    if 0xE1 <= byte <= 0xEF:
        return CONT2
    return CONT3 if 0xF1 <= byte <= 0xF3 else _INVALID  # 80..C1 and F5..FF never start a character


def _transition_table() -> list[bytes]:
    table = [bytes(_after_lead(b) for b in range(256))]
    for state in range(1, _NUM_STATES):
        low, high, then = _NEXT_BYTE[state]
        table.append(bytes(then if low <= b <= high else _INVALID for b in range(256)))
    return table


_TABLE = _transition_table()


class Utf8Guard:
    """For one vocabulary: per automaton state, the state each token leads to (255: invalid) and the packed
    bitmask words of the valid tokens (bit set = allowed; one more row of all bits set, for UNRESTRICTED)."""

    __slots__ = ("next_state", "allowed_words")

    def __init__(self, token_bytes: Sequence[bytes]):
        # an ASCII token keeps a character boundary and breaks a character; the others are run byte by byte
        self.next_state = [bytearray([BOUNDARY if state == BOUNDARY else _INVALID]) * len(token_bytes)
                           for state in range(_NUM_STATES)]
        for token, raw in enumerate(token_bytes):
            if not raw or not raw.isascii():
                for state in range(_NUM_STATES):
                    self.next_state[state][token] = _run(state, raw)
        allowed = [_packed_allowed(row) for row in self.next_state]
        self.allowed_words = torch.stack([*allowed, torch.full_like(allowed[0], -1)])

    def advance(self, state: int, token: int) -> int | None:
        """The state after `token`, or None where it would make the output invalid UTF-8."""
        following = self.next_state[state][token] if 0 <= token < len(self.next_state[state]) else state
        return None if following == _INVALID else following

    def restrict(self, bitmask: torch.Tensor, states: list[int]) -> None:
        """Clear the invalid tokens' bits in the rows of an xgrammar bitmask [B, W] (int32 words, bit j of word w
        is token 32w + j), row i for the automaton state states[i], in one operation; tokens past the vocabulary
        are left to xgrammar."""
        bitmask[:, :self.allowed_words.shape[1]] &= self.allowed_words.index_select(0, torch.tensor(states))


def _run(state: int, raw: bytes) -> int:
    for byte in raw:
        state = _TABLE[state][byte]
        if state == _INVALID:
            break
    return state


def _packed_allowed(next_state: bytearray) -> torch.Tensor:
    allowed = torch.frombuffer(next_state, dtype=torch.uint8) != _INVALID
    padded = torch.ones(-(-len(next_state) // 32) * 32, dtype=torch.int64)
    padded[:len(next_state)] = allowed.to(torch.int64)
    words = (padded.view(-1, 32) << torch.arange(32)).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
