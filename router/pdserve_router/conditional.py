"""Conditional disaggregation: send a request to a decode instance alone, which prefills it itself, when that is
cheaper than the remote path.

Local wins when the prompt is short (`--local-prefill-max-tokens`), or when the least loaded prefill instance's
queued prompt tokens, at its measured prefill rate, would make the prompt wait longer than prefilling it locally
takes (`--local-prefill-cost-factor` times the prefill time on that instance: the decode instance alternates its
prefill chunks with decode steps, and may be a different GPU). The uncached prompt is taken to be all of it: the
rule does not weigh what the instances' prefix caches hold. The prefill instances report their load on `/load`,
polled by `workers.LoadPoller`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CHARS_PER_TOKEN = 4  # prompt text -> token estimate (the router has no tokenizer)


@dataclass(frozen=True, slots=True)
class PrefillLoad:
    queued_tokens: int
    tokens_per_s: float  # 0.0: not measured yet

    def wait_s(self, prompt_tokens: int) -> float | None:
        """Seconds until this instance has prefilled the queue and the prompt; None without a measured rate."""
        if self.tokens_per_s <= 0:
            return None
        return (self.queued_tokens + prompt_tokens) / self.tokens_per_s


@dataclass(frozen=True, slots=True)
class LocalPrefillRule:
    max_tokens: int = 0  # prompts up to this many tokens are prefilled on the decode instance (0: never for that)
    cost_factor: float = 0.0  # a local prefill takes this many times as long as a remote one (0: never for load)

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0 or self.cost_factor > 0

    def prefill_locally(self, prompt_tokens: int | None, loads: Sequence[PrefillLoad | None]) -> bool:
        """True when the decode instance should prefill a prompt of about `prompt_tokens` tokens itself."""
        if prompt_tokens is None:
            return False
        if prompt_tokens <= self.max_tokens:
            return True
        if self.cost_factor <= 0 or not loads or any(load is None or load.tokens_per_s <= 0 for load in loads):
            return False  # an instance without a measurement may be idle: the remote path is not known to be slow
        best = min(loads, key=lambda load: load.wait_s(prompt_tokens))
        local_s = self.cost_factor * prompt_tokens / best.tokens_per_s
        return best.wait_s(prompt_tokens) > local_s


def estimate_prompt_tokens(key: str | Sequence | None) -> int | None:
    """The prompt of `payload.routing_key`: token ids count themselves, text is estimated from its length.
    None when the request has no prompt."""
    if key is None:
        return None
    if isinstance(key, str):
        return -(-len(key.encode("utf-8", "surrogatepass")) // CHARS_PER_TOKEN)
    return len(key)


def parse_load(body: object) -> PrefillLoad | None:
    """A `/load` answer, or None when it does not look like one."""
    if not isinstance(body, dict):
        return None
    queued, rate = body.get("queued_prefill_tokens"), body.get("prefill_tokens_per_s")
    if type(queued) is not int or queued < 0 or not isinstance(rate, (int, float)) or isinstance(rate, bool):
        return None
    if not 0 <= rate < float("inf"):
        return None
    return PrefillLoad(queued, float(rate))
