"""What a server reports about its prefill load: the prompt tokens queued and the rate it prefills them at.

The router's conditional disaggregation reads both (the `/load` route) to estimate how long a new prompt would
wait on a prefill instance.
"""

from __future__ import annotations

DECAY = 0.9  # weight of the history at each new extend step


class PrefillRateMeter:
    """Prompt tokens per second over recent extend steps, each step weighted by its duration (decaying sums)."""

    __slots__ = ("tokens", "seconds")

    def __init__(self) -> None:
        self.tokens = 0.0
        self.seconds = 0.0

    def record(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self.tokens = self.tokens * DECAY + tokens
        self.seconds = self.seconds * DECAY + seconds

    @property
    def tokens_per_s(self) -> float:
        """0.0 until the first extend step: no measurement yet."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0
