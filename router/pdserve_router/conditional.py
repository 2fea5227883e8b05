"""Conditional disaggregation: send a request to a decode instance alone, which prefills it itself, when that is
cheaper than the remote path.

Two rules, one at a time:

- Static (`LocalPrefillRule`): local when the prompt is short (`--local-prefill-max-tokens`), or when the least
  loaded prefill instance's queued prompt tokens, at its measured prefill rate, would make the prompt wait longer
  than prefilling it locally takes (`--local-prefill-cost-factor` times the prefill time on that instance).
- Load-aware (`LoadAwareRule`, `--local-prefill-by-load`): per request, a predicted time to first token on each
  path. Remote: the best prefill instance's wait (its queued prompt tokens, plus those the router sent it that its
  last report cannot show yet, plus this prompt, at its measured rate) plus the handoff overhead the router learns
  from its own remote requests (`LearnedOverhead`). Local, per decode instance: the same sum over its queue, of
  which the tokens its saved credit pays for (`local_prefill_burst_s`, at its full-speed extend line) go at full
  speed and the rest at the rate it reports it can prefill while its running decodes stay within its TPOT budget,
  plus the local path's own learned overhead. Booked tokens count in the sum, so prompts sent between two polls
  share one burst. Local wins on the decode instance with the lowest prediction when that instance reports a
  budget, its KV usage is below the gate, and its prediction is below alpha times the remote one.

The load-aware rule sizes a text prompt at the bytes per token the servers' answers show (`PromptSizer`), the
static ones at CHARS_PER_TOKEN. The uncached prompt is taken to be all of it: neither rule weighs what the
instances' prefix caches hold. The instances report their load on `/load`, polled by `workers.LoadPoller`; the
router books each prompt's tokens on the instance it sends it to (`BookedTokens`), so that requests between two
polls see each other.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

CHARS_PER_TOKEN = 4  # prompt text -> token estimate (the router has no tokenizer)
MAX_REPORTED_TOKENS = 1 << 40  # a larger queue in a /load answer is not believed
# A request the router has sent is in an instance's /load answer only once the server has queued it; a report
# asked for this long after the dispatch is taken to include it.
INGEST_MARGIN_S = 0.05
EWMA_WEIGHT = 0.1  # of each new observation in a learned overhead's or text size's moving average
MAX_OVERHEAD_SAMPLE_S = 60.0  # an observation is clipped to +-this (a stalled request must not own the average)
BYTES_PER_TOKEN_RANGE = (1.0, 32.0)  # an observed text size is clipped to this (a tokenizer's plausible span)
MAX_PROMPT_TOKENS = 1 << 30  # a larger reported prompt is not believed


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """An instance's `/load` answer: prompt tokens queued, its measured full-speed prefill rate (0.0: not measured
    yet), the rate at which it can prefill prompts of its own right now within its TPOT budget (a decode
    instance; 0.0: it takes none now) and the fraction of its KV pool in use; a decode instance's saved credit
    (seconds of full-speed prefill it may spend now) and its full-speed extend line (fixed seconds, seconds per
    token)."""

    queued_tokens: int
    tokens_per_s: float
    local_tokens_per_s: float = 0.0
    kv_usage: float = 1.0
    burst_s: float = 0.0
    extend_fixed_s: float = 0.0
    extend_s_per_token: float = 0.0

    def wait_s(self, prompt_tokens: int) -> float | None:
        """Seconds until this instance has prefilled the queue and the prompt; None without a measured rate."""
        if self.tokens_per_s <= 0:
            return None
        return (self.queued_tokens + prompt_tokens) / self.tokens_per_s

    def local_wait_s(self, tokens: int) -> float | None:
        """Seconds until this decode instance has prefilled `tokens` of its own: those its saved credit pays for at
        full speed (in one extend), the rest at its budgeted rate; None when it takes no local prefill now."""
        if self.local_tokens_per_s <= 0:
            return None
        at_full_speed = self.burst_tokens(tokens)
        burst_s = self.extend_fixed_s + self.extend_s_per_token * at_full_speed if at_full_speed else 0.0
        return burst_s + (tokens - at_full_speed) / self.local_tokens_per_s

    def burst_tokens(self, tokens: int) -> int:
        """How many of `tokens` one full-speed extend within the saved credit takes (0: no credit or no line)."""
        if self.extend_s_per_token <= 0 or self.burst_s <= self.extend_fixed_s:
            return 0
        return int(min(tokens, (self.burst_s - self.extend_fixed_s) / self.extend_s_per_token))


@dataclass(frozen=True, slots=True)
class LocalPrefillRule:
    max_tokens: int = 0  # prompts up to this many tokens are prefilled on the decode instance (0: never for that)
    cost_factor: float = 0.0  # a local prefill takes this many times as long as a remote one (0: never for load)

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0 or self.cost_factor > 0

    def prefill_locally(self, prompt_tokens: int | None, loads: Sequence[InstanceLoad | None]) -> bool:
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


@dataclass(frozen=True, slots=True)
class Option:
    """An instance as the load-aware rule sees it: its last report (None: none) and the prompt tokens the router
    sent it since that the report cannot show."""

    load: InstanceLoad | None
    booked_tokens: int = 0

    def prefill_wait_s(self, prompt_tokens: int) -> float | None:
        """As a prefill instance: seconds until it has prefilled its queue, the booked tokens and the prompt."""
        return None if self.load is None else self.load.wait_s(self.booked_tokens + prompt_tokens)

    def local_wait_s(self, prompt_tokens: int) -> float | None:
        """As a decode instance: the same on its own (its saved credit first, then its budgeted rate); None when it
        takes no local prefill now."""
        if self.load is None:
            return None
        return self.load.local_wait_s(self.load.queued_tokens + self.booked_tokens + prompt_tokens)


# why a load-aware choice went the way it did (the reason label of its metric)
FASTER = "local_faster"
SLOWER = "remote_faster"
UNMEASURED = "prefill_unmeasured"
NO_BUDGET = "no_budget"
KV_GATE = "kv_gate"


@dataclass(frozen=True, slots=True)
class LoadDecision:
    decode: int | None  # the index of the decode instance that prefills the prompt itself; None: the remote path
    reason: str
    local_s: float | None  # the best decode instance's predicted time to first token (None: none takes it)
    remote_s: float | None  # the remote path's (None: a prefill instance has no measured rate)


@dataclass(frozen=True, slots=True)
class LoadAwareRule:
    alpha: float = 1.0  # local wins when its prediction is below alpha times the remote one
    kv_gate: float = 0.9  # a decode instance whose KV usage reaches this fraction takes no local prefill

    def decide(self, prompt_tokens: int, prefills: Sequence[Option], decodes: Sequence[Option],
               remote_overhead_s: float, local_overhead_s: float = 0.0) -> LoadDecision:
        """The overheads are what each path takes beyond its predicted wait (`LearnedOverhead.value`)."""
        waits = [option.prefill_wait_s(prompt_tokens) for option in prefills]
        remote_s = None if not waits or None in waits else min(waits) + remote_overhead_s
        budgeted = [(wait, i) for i, option in enumerate(decodes)
                    if (wait := option.local_wait_s(prompt_tokens)) is not None]
        open_ = [(wait, i) for wait, i in budgeted if decodes[i].load.kv_usage < self.kv_gate]
        if not open_:
            return LoadDecision(None, KV_GATE if budgeted else NO_BUDGET, None, remote_s)
        local_wait_s, best = min(open_)
        local_s = local_wait_s + local_overhead_s
        if remote_s is None:  # an instance without a measurement may be idle: the remote path is not known slow
            return LoadDecision(None, UNMEASURED, local_s, None)
        if local_s < self.alpha * remote_s:
            return LoadDecision(best, FASTER, local_s, remote_s)
        return LoadDecision(None, SLOWER, local_s, remote_s)


@dataclass(slots=True)
class MovingAverage:
    """An exponentially weighted moving average whose first sample sets it; `value` until then."""

    value: float
    samples: int = 0

    def add(self, sample: float) -> None:
        self.value = sample if not self.samples else self.value + EWMA_WEIGHT * (sample - self.value)
        self.samples += 1


@dataclass(slots=True)
class LearnedOverhead:
    """What one path takes beyond its predicted wait: remote, the KV transfer, the decode's first step and the hops
    (the handoff); local, the decode steps between the prefill chunks and the hop; on both, any steady error of the
    prediction. A moving average of the router's own observations of streamed requests on that path, first byte
    minus predicted wait; not below zero when used."""

    seconds: MovingAverage = field(default_factory=lambda: MovingAverage(0.0))

    def observe(self, first_byte_s: float, predicted_wait_s: float) -> None:
        self.seconds.add(min(max(first_byte_s - predicted_wait_s, -MAX_OVERHEAD_SAMPLE_S), MAX_OVERHEAD_SAMPLE_S))

    @property
    def value(self) -> float:
        return max(self.seconds.value, 0.0)


@dataclass(eq=False, slots=True)
class Booking:
    tokens: int
    booked_at: float  # time.monotonic() at dispatch


@dataclass(slots=True)
class BookedTokens:
    """Prompt tokens the router sent to one instance that its load report cannot show yet. A booking ends at its
    request's first byte or failure, at the prefill's answer (remote path), or once a report asked for
    INGEST_MARGIN_S after it counts it, whichever comes first."""

    live: set[Booking] = field(default_factory=set)

    def book(self, tokens: int, now: float) -> Booking:
        booking = Booking(tokens, now)
        self.live.add(booking)
        return booking

    def release(self, booking: Booking) -> None:
        self.live.discard(booking)

    def unseen(self, report_asked_at: float) -> int:
        """The booked tokens that the instance's latest report, asked for at `report_asked_at`, cannot include;
        the bookings it includes end (reports are asked for later and later)."""
        seen_before = report_asked_at - INGEST_MARGIN_S
        self.live = {b for b in self.live if b.booked_at > seen_before}
        return sum(b.tokens for b in self.live)


def estimate_prompt_tokens(key: str | Sequence | None, bytes_per_token: float = CHARS_PER_TOKEN) -> int | None:
    """The prompt of `payload.routing_key`: token ids count themselves, text is estimated from its UTF-8 length.
    None when the request has no prompt."""
    if key is None:
        return None
    if isinstance(key, str):
        return math.ceil(text_bytes(key) / bytes_per_token)
    return len(key)


def text_bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


@dataclass(slots=True)
class PromptSizer:
    """The load-aware rule's prompt size: text at the UTF-8 bytes per token of the prompts the servers counted
    (`meta_info.prompt_tokens` of /generate answers; a moving average), CHARS_PER_TOKEN until one is seen. The
    instances report their queues in their tokenizer's tokens, so the prompt must be counted in the same."""

    bytes_per_token: MovingAverage = field(default_factory=lambda: MovingAverage(float(CHARS_PER_TOKEN)))

    def tokens(self, key: str | Sequence | None) -> int | None:
        return estimate_prompt_tokens(key, self.bytes_per_token.value)

    def observe(self, prompt_bytes: int, answer: bytes, stream: bool) -> None:
        """Learns from the first event (stream) or the body of a /generate answer to a text prompt."""
        tokens = reported_prompt_tokens(answer, stream)
        if tokens is None:
            return
        low, high = BYTES_PER_TOKEN_RANGE
        self.bytes_per_token.add(min(max(prompt_bytes / tokens, low), high))


def reported_prompt_tokens(answer: bytes, stream: bool) -> int | None:
    """`meta_info.prompt_tokens` of a /generate answer (a stream's first event), or None."""
    if stream:
        event = answer.split(b"\n\n", 1)[0]
        if not event.startswith(b"data: {"):
            return None
        answer = event[6:]
    try:
        body = json.loads(answer)
    except (ValueError, RecursionError):
        return None
    meta = body.get("meta_info") if isinstance(body, dict) else None
    tokens = meta.get("prompt_tokens") if isinstance(meta, dict) else None
    return tokens if type(tokens) is int and 0 < tokens <= MAX_PROMPT_TOKENS else None


def parse_load(body: object) -> InstanceLoad | None:
    """A `/load` answer, or None when it does not look like one. An answer without a valid local prefill rate and
    KV usage (a prefill instance, an older server) takes no local prefill; one without a valid saved credit and
    extend line has none."""
    if not isinstance(body, dict):
        return None
    queued, rate = _count(body.get("queued_prefill_tokens")), _non_negative(body.get("prefill_tokens_per_s"))
    if queued is None or rate is None:
        return None
    local_rate, kv_usage = _non_negative(body.get("local_prefill_tokens_per_s")), _non_negative(body.get("kv_usage"))
    if local_rate is None or kv_usage is None or kv_usage > 1:
        return InstanceLoad(queued, rate)
    burst = [_non_negative(body.get(key))
             for key in ("local_prefill_burst_s", "extend_fixed_ms", "extend_us_per_token")]
    if None in burst:
        return InstanceLoad(queued, rate, local_rate, kv_usage)
    burst_s, fixed_ms, us_per_token = burst
    return InstanceLoad(queued, rate, local_rate, kv_usage, burst_s, fixed_ms / 1e3, us_per_token / 1e6)


def _count(value: object) -> int | None:
    return value if type(value) is int and 0 <= value <= MAX_REPORTED_TOKENS else None


def _non_negative(value: object) -> float | None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        return None
    return float(value)
