"""Prefill within a TPOT budget (`--decode-tpot-budget-ms`): how many prompt tokens the next extend may take so that
the running requests' mean inter-token time stays within the budget.

A step runs either an extend or a decode forward (`Scheduler.step`), so this is Sarathi-Serve's stall-free batching
by time slicing: while requests decode, every decode step earns the budget minus its own time as credit, and every
extend spends its time. Over n decode steps and the extends between them, each running request receives n tokens
in (sum of decode times + sum of extend times) <= n x budget as long as the credit does not stay negative. An extend
runs whenever the credit is positive and takes at least an efficient chunk: `SAVED_CHUNK_TOKENS`, or the prompt
tokens queued if fewer, more when the credit pays for more (page-aligned). What it costs beyond the credit is a debt
the next decode steps repay before another extend runs. Large chunks keep prefill efficient: an eager forward has a
large fixed cost (about 19 ms for llama-3.1-8b on an H200, measured 2026-11-28), so 256-token chunks cost about three
times as much per token as 2,048-token ones, and the budget would buy that much less prefill. Borrowing rather than
saving up first starts a prompt at once (its TTFT) at the same mean inter-token time, which is what the budget keeps;
a large chunk makes one longer gap. With no request decoding, prefill runs
at full speed (`max_chunk`) and the credit starts over at zero.

Saved credit (`--decode-tpot-burst-ms`): the credit is held up to the steady cap (CREDIT_CAP_BUDGETS budgets, or one
saved chunk's time), or up to the burst if that is more, so a lightly loaded server saves enough to prefill a long
prompt at full speed in one gap. The SLO is a request's mean inter-token time, and a burst must not push it over
the budget, so a request may only ever meet as much credit as without bursts plus what it banked itself: the
controller keeps a ledger (the credit without its cap) and each running request's ledger value when it joined, and
an extend spends at most min(credit, steady cap + the least any running request has banked since it joined)
(`_spendable_s`). The invariant, per request: its inter-token times sum to at most its tokens x budget + the steady
cap (the credit it may meet on joining) + the debt limit (what an extend may borrow, repaid after); without a
burst the spendable credit is the credit and this is the bound the controller always kept. A request that joins a
server with saved credit meets a steady cap's worth, not the burst; requests that ran through the saving spend it.
Off by default: on two H200s (2026-11-28, the mix, 1p1d-balanced, budget 8.5 ms) a 250 ms burst brought the TTFT
p90 at 4 req/s from 1.22x to 1.08x colocated's, but at 7 req/s and above the documents it drew onto the decode
delayed the chats behind them (TTFT p50 168 against 77 ms at 7 req/s) and the goodput fell to 8.9 req/s (docs/
benchmarks.md). 250 ms is one full-speed prefill of that mix's longest prompts (6-8k tokens, 190-250 ms).

The step costs are learned online from the server's own timings (`StepCosts`): the decode step's time as a decaying
average, and an extend's time as a line (fixed cost + cost per token) fitted over recent extends. The warm-up seeds
both (`warmup.py`), so they are known before the first request.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MIN_CHUNK_TOKENS = 256  # a smaller prefill chunk wastes the GPU (its fixed cost dominates)
SAVED_CHUNK_TOKENS = 2048  # while requests decode, an extend takes at least this many tokens (or all queued)
CREDIT_CAP_BUDGETS = 4.0  # steady cap, in budgets (or one saved chunk's time): no flood after a quiet spell
MIN_EARN_SHARE = 0.1  # a decode step earns at least this share of the budget: prefill never starves
DECODE_EWMA = 0.1  # weight of a new decode step's time
EXTEND_DECAY = 0.9  # weight of the history at each new extend
OUTLIER_FACTOR = 4.0  # a step counts as at most this many times its predicted time (a host pause is not its cost)
LOG_EVERY_DECODE_STEPS = 5000  # a log line on the budget's work at most this often (~30 s of decoding)


@dataclass(slots=True)
class StepCosts:
    """Forward times learned from measured steps: a decode step's, and an extend's as a function of its tokens."""

    decode_s: float = 0.0  # 0.0: no decode step measured yet
    # decaying sums of the extends' (tokens, seconds) for a least-squares line
    weight: float = 0.0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0

    def record_decode(self, seconds: float) -> None:
        if seconds <= 0:
            return
        if self.decode_s == 0.0:
            self.decode_s = seconds
            return
        self.decode_s += DECODE_EWMA * (min(seconds, OUTLIER_FACTOR * self.decode_s) - self.decode_s)

    def record_extend(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        if self.knows_extend:
            seconds = min(seconds, OUTLIER_FACTOR * self.extend_s(tokens))
        d = EXTEND_DECAY
        self.weight = self.weight * d + 1.0
        self.sum_x = self.sum_x * d + tokens
        self.sum_y = self.sum_y * d + seconds
        self.sum_xx = self.sum_xx * d + tokens * tokens
        self.sum_xy = self.sum_xy * d + tokens * seconds

    @property
    def knows_extend(self) -> bool:
        return self.weight > 0

    def extend_line(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token) of an extend; a line through the origin when the recent extends'
        sizes do not determine a fixed cost (all alike, or a fit below zero). (0, 0) before any extend."""
        if not self.knows_extend:
            return 0.0, 0.0
        spread = self.weight * self.sum_xx - self.sum_x * self.sum_x
        if spread > 1e-9 * self.weight * self.sum_xx:
            per_token = (self.weight * self.sum_xy - self.sum_x * self.sum_y) / spread
            fixed = (self.sum_y - per_token * self.sum_x) / self.weight
            if per_token > 0 and fixed >= 0:
                return fixed, per_token
        return 0.0, self.sum_y / self.sum_x

    def extend_s(self, tokens: int) -> float:
        fixed, per_token = self.extend_line()
        return fixed + per_token * tokens

    def prefill_rate(self, chunk: int) -> float:
        """Prompt tokens per second in extends of `chunk` tokens; 0.0 before any extend."""
        seconds = self.extend_s(chunk)
        return chunk / seconds if seconds > 0 else 0.0

    def forget(self) -> None:
        """Back to nothing measured (the warm-up's compiles are not a step's cost)."""
        self.decode_s = self.weight = self.sum_x = self.sum_y = self.sum_xx = self.sum_xy = 0.0


class TpotBudget:
    """The credit controller the scheduler asks before each extend (`extend_tokens`) and tells about each forward.
    A budget of 0 is off: every extend may take `max_chunk` tokens (the costs are learned all the same, for
    `/load`). `burst_ms` > 0 saves credit up to that much; `running_ids` then names the running requests (whose
    joins the ledger dates)."""

    __slots__ = ("budget_s", "burst_s", "max_chunk", "min_chunk", "saved_chunk", "page_size", "costs", "credit_s",
                 "counters", "window", "running_ids", "ledger_s", "joined_at", "newest_join_s")

    def __init__(self, budget_ms: float, page_size: int, max_chunk: int, costs: StepCosts | None = None,
                 burst_ms: float = 0.0, running_ids: Callable[[], Iterable[str]] = tuple):
        self.budget_s = budget_ms / 1e3
        self.burst_s = burst_ms / 1e3
        self.page_size = page_size
        self.max_chunk = max_chunk
        self.min_chunk = min(max_chunk, _round_up(MIN_CHUNK_TOKENS, page_size))
        self.saved_chunk = min(max_chunk, _round_up(SAVED_CHUNK_TOKENS, page_size))
        self.costs = costs or StepCosts()
        self.credit_s = 0.0
        self.counters = BudgetCounters()
        self.window = BudgetCounters()  # since the last log line
        self.running_ids = running_ids
        self.ledger_s = 0.0  # the credit without its cap (bursts only): what a request banked is its change
        self.joined_at: dict[str, float] = {}  # running request -> the ledger when it joined
        self.newest_join_s = 0.0  # the largest of joined_at: the least banked is ledger_s minus this

    @classmethod
    def from_args(cls, args, page_size: int, running_ids: Callable[[], Iterable[str]]) -> TpotBudget:
        """The server's budget: `--decode-tpot-budget-ms`, `--decode-tpot-burst-ms`, and extends of at most one
        prefill batch or chunk."""
        return cls(args.decode_tpot_budget_ms, page_size, min(args.max_prefill_tokens, args.chunked_prefill_size),
                   burst_ms=args.decode_tpot_burst_ms, running_ids=running_ids)

    @property
    def enabled(self) -> bool:
        return self.budget_s > 0

    @property
    def bursts(self) -> bool:
        return self.enabled and self.burst_s > 0

    def extend_tokens(self, decoding: bool, queued_tokens: int | None = None) -> int:
        """The most prompt tokens the next extend may take; 0: run a decode step first. `decoding`: requests are
        running (their next token waits behind any extend); `queued_tokens`: the prompt tokens waiting (None: at
        least a saved chunk's)."""
        if not self.enabled or not decoding:
            return self.max_chunk
        spendable = self._spendable_s()
        if spendable <= 0:
            return 0
        return max(self._saved_target(queued_tokens), self._tokens_within(spendable))

    def _spendable_s(self) -> float:
        """The credit the next extend may spend: all of it without bursts, else no more than the steady cap plus
        what every running request has banked since it joined."""
        if not self.bursts:
            return self.credit_s
        self._date_joins()
        return min(self.credit_s, self._steady_cap_s() + self.ledger_s - self.newest_join_s)

    def _date_joins(self) -> None:
        """Notes the ledger at each new running request's join and forgets those that left (a pass over the running
        requests). Called as each forward is launched, before it moves the ledger: the requests running then earn
        or pay for it, those that join later do not."""
        before, ledger = self.joined_at, self.ledger_s
        self.joined_at = {rid: before.get(rid, ledger) for rid in self.running_ids()}
        self.newest_join_s = max(self.joined_at.values(), default=ledger)

    def _saved_target(self, queued_tokens: int | None) -> int:
        """The least an extend takes: a saved chunk, or the queued tokens (page-aligned) if fewer."""
        if queued_tokens is None:
            return self.saved_chunk
        return max(self.page_size, min(self.saved_chunk, _round_up(queued_tokens, self.page_size)))

    def _tokens_within(self, seconds: float) -> int:
        """The largest page-aligned chunk (up to max_chunk) whose predicted time fits `seconds`."""
        fixed, per_token = self.costs.extend_line()
        if per_token <= 0:
            return self.min_chunk  # nothing measured: the smallest efficient chunk
        pages = math.floor((seconds - fixed) / per_token / self.page_size)
        return min(self.max_chunk, max(0, pages) * self.page_size)

    def extend_started(self, tokens: int, decoding: bool) -> float | None:
        """An extend of `tokens` is launched: its predicted time is charged now (its measured time settles the
        charge, `extend_measured`). Returns the charge, None when no request was decoding (nothing charged: the
        credit starts over)."""
        if not self.enabled or not decoding:
            self._start_over()
            return None
        if self.bursts:
            self._date_joins()
        charge = self.costs.extend_s(tokens)
        self.credit_s -= charge
        self.ledger_s -= charge
        return charge

    def _start_over(self) -> None:
        self.credit_s = self.ledger_s = self.newest_join_s = 0.0
        self.joined_at = {}

    def extend_measured(self, tokens: int, seconds: float, charged: float | None) -> None:
        """An extend's measured time, for the cost model and, when it was charged, the credit. One outlier (a host
        pause) leaves at most the debt limit (one saved chunk's time, or the steady cap), on the credit and on what
        the running requests banked."""
        if charged is not None:
            self.counters.extend(tokens, seconds)
            self.window.extend(tokens, seconds)
            steady = self._steady_cap_s()  # also the debt limit
            self.credit_s = max(self.credit_s + charged - seconds, -steady)
            self.ledger_s = max(self.ledger_s + charged - seconds, self.newest_join_s - 2 * steady)
        self.costs.record_extend(tokens, seconds)

    def decode_started(self) -> float | None:
        """A decode step is launched: it earns what its learned time leaves of the budget now (its measured time
        settles that, `decode_measured`). Returns what it earned (before the cap), None without a budget."""
        if not self.enabled:
            return None
        if self.bursts:
            self._date_joins()
        earned = self._earned(self.costs.decode_s or self.budget_s)  # unmeasured: the least it may earn
        self._add_credit(earned)
        return earned

    def decode_measured(self, seconds: float, credited: float | None) -> None:
        """A decode step's measured time (step to step), for the cost model and the credit it earned."""
        if credited is not None:
            self.counters.decode(seconds)
            self.window.decode(seconds)
            self._add_credit(self._earned(seconds) - credited)
            self._log_window()
        self.costs.record_decode(seconds)

    def _log_window(self) -> None:
        """One line per LOG_EVERY_DECODE_STEPS decode steps in which prompts were prefilled beside them."""
        window = self.window
        if window.decode_steps < LOG_EVERY_DECODE_STEPS:
            return
        self.window = BudgetCounters()
        if not window.extends:
            return
        fixed, per_token = self.costs.extend_line()
        logger.info("TPOT budget %g ms: %d decode steps, %d prefill chunks (%d tokens) beside them, mean inter-token "
                    "time %.2f ms; learned: decode step %.2f ms, chunk %.2f ms + %.2f us per token",
                    self.budget_s * 1e3, window.decode_steps, window.extends, window.extend_tokens,
                    window.mean_itl_s * 1e3, self.costs.decode_s * 1e3, fixed * 1e3, per_token * 1e6)

    def _earned(self, decode_s: float) -> float:
        return max(self.budget_s - decode_s, MIN_EARN_SHARE * self.budget_s)

    def _add_credit(self, seconds: float) -> None:
        self.credit_s = min(self.credit_s + seconds, max(self._steady_cap_s(), self.burst_s))
        self.ledger_s += seconds

    def _steady_cap_s(self) -> float:
        """The credit held without bursts, and the debt limit."""
        return max(CREDIT_CAP_BUDGETS * self.budget_s, self.costs.extend_s(self.saved_chunk))

    def prefill_share(self) -> float:
        """The share of the GPU's time prefill takes while requests decode within the budget."""
        if not self.enabled:
            return 1.0
        decode = self.costs.decode_s
        earned = self._earned(decode)
        return earned / (earned + decode)

    def prefill_rate(self, decoding: bool) -> float:
        """Prompt tokens per second this server prefills now: at full speed in the largest chunks when nothing
        decodes (or without a budget), else in saved chunks for the budget's share of the time. 0.0 unmeasured."""
        if not self.enabled or not decoding:
            return self.costs.prefill_rate(self.max_chunk)
        return self.costs.prefill_rate(self.saved_chunk) * self.prefill_share()

    def burst_s_now(self) -> float:
        """Seconds of full-speed prefill the next extend may spend from saved credit (0.0 without bursts, or with no
        request decoding: a prompt then goes at full speed anyway)."""
        if not self.bursts:
            return 0.0
        spendable = self._spendable_s()
        return max(spendable, 0.0) if self.joined_at else 0.0

    def load_report(self) -> dict:
        """`/load`'s part of the budget: the saved credit a new prompt may use at full speed, and the extend line
        that converts it to tokens (the router predicts a local prefill's time from them)."""
        fixed, per_token = self.costs.extend_line()
        return {"local_prefill_burst_s": round(self.burst_s_now(), 6), "extend_fixed_ms": round(fixed * 1e3, 3),
                "extend_us_per_token": round(per_token * 1e6, 4)}

    def reset(self) -> None:
        """The credit and counters start over; the learned costs stay (they describe the hardware)."""
        self._start_over()
        self.counters = BudgetCounters()
        self.window = BudgetCounters()

    def stats(self) -> dict:
        fixed, per_token = self.costs.extend_line()
        return {"credit_ms": round(self.credit_s * 1e3, 3), "burst_ms": round(self.burst_s_now() * 1e3, 3),
                "extend_fixed_ms": round(fixed * 1e3, 3),
                "extend_us_per_token": round(per_token * 1e6, 4), **self.counters.stats()}


@dataclass(slots=True)
class BudgetCounters:
    """What the budget let through while requests decoded: the achieved mean inter-token time is
    (decode_s + extend_s) / decode_steps."""

    decode_steps: int = 0
    decode_s: float = 0.0
    extends: int = 0
    extend_tokens: int = 0
    extend_s: float = 0.0

    def decode(self, seconds: float) -> None:
        self.decode_steps += 1
        self.decode_s += seconds

    def extend(self, tokens: int, seconds: float) -> None:
        self.extends += 1
        self.extend_tokens += tokens
        self.extend_s += seconds

    @property
    def mean_itl_s(self) -> float:
        return (self.decode_s + self.extend_s) / self.decode_steps if self.decode_steps else 0.0

    def stats(self) -> dict:
        return {"decode_steps": self.decode_steps, "extends": self.extends, "extend_tokens": self.extend_tokens,
                "mean_itl_ms": round(self.mean_itl_s * 1e3, 3)}


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
