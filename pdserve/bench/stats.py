"""Statistics of a run (SGLang bench_serving's definitions) and the goodput search.

- TTFT: send to first token. E2E: send to last token. TPOT of a request: (E2E - TTFT) / (output tokens - 1),
  for requests with two or more tokens. ITL: every gap between token arrivals, over all requests (a chunk of
  k tokens counts k gaps of gap / k).
- SLO attainment: the fraction of requests (errors included, client aborts excluded) that succeeded with
  TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms. Goodput: the highest request rate whose attainment is at
  least the target (90%), found by a sweep upwards from the given rates (doubling past them up to a cap) and a
  bisection (`find_goodput`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.bench.client import RequestResult

PERCENTILES = (50, 90, 99)
ATTAINMENT_TARGET = 0.9
ERROR_EXAMPLES = 10
DEFAULT_MAX_RATE = 64.0


def distribution(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean and p50/p90/p99 in milliseconds (numpy's linear interpolation); None for an empty sample."""
    if not len(values_s):
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def misses(self, result: RequestResult) -> list[str]:
        """What `result` misses: "failed" for a failed request, else "ttft" and/or "tpot" (a request of one
        token has no TPOT)."""
        if not result.success:
            return ["failed"]
        missed = []
        if self.ttft_ms is not None and result.ttft * 1000.0 > self.ttft_ms:
            missed.append("ttft")
        tpot = result.tpot
        if self.tpot_ms is not None and tpot is not None and tpot * 1000.0 > self.tpot_ms:
            missed.append("tpot")
        return missed

    def met(self, result: RequestResult) -> bool:
        return not self.misses(result)

    def limits(self) -> dict[str, str]:
        """The SLO's terms in words, by the names `misses` gives them."""
        return {name: f"{name.upper()} <= {limit:g} ms" for name, limit in (("ttft", self.ttft_ms),
                                                                           ("tpot", self.tpot_ms))
                if limit is not None}

    def describe(self) -> str:
        return " and ".join(self.limits().values()) or "no SLO"


def summarize(results: Sequence[RequestResult], duration_s: float, slo: Slo) -> dict:
    """Counts, throughput, latency distributions and SLO attainment of one run."""
    done = [r for r in results if r.success]
    failed = [r for r in results if not r.success and not r.aborted]
    judged = len(done) + len(failed)
    good = sum(slo.met(r) for r in done)
    tpots = [t for r in done if (t := r.tpot) is not None]
    duration_s = max(duration_s, 1e-9)
    return {
        "requests": len(results), "completed": len(done), "errors": len(failed),
        "aborted": sum(r.aborted for r in results),
        "error_kinds": dict(Counter(error_kind(r.error) for r in failed)),
        "first_errors": first_error_of_each_kind(failed),
        "error_examples": [r.error for r in failed[:ERROR_EXAMPLES]],
        "duration_s": duration_s,
        "input_tokens": sum(r.input_len for r in done),
        "output_tokens": sum(r.output_len for r in done),
        "request_throughput": len(done) / duration_s,
        "input_throughput": sum(r.input_len for r in done) / duration_s,
        "output_throughput": sum(r.output_len for r in done) / duration_s,
        "ttft_ms": distribution([r.ttft for r in done]),
        "tpot_ms": distribution(tpots),
        "itl_ms": distribution([gap for r in done for gap in r.itl]),
        "e2e_ms": distribution([r.latency for r in done]),
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "slo_attainment": good / judged if judged else None,
        "slo_misses": dict(Counter(term for r in [*done, *failed] for term in slo.misses(r))),
        "good_request_throughput": good / duration_s,
    }


def error_kind(error: str) -> str:
    """The leading words of an error ("HTTP 503", "timeout", "ClientPayloadError", ...) for counting."""
    return error.split(":", 1)[0].strip() or "unknown"


def first_error_of_each_kind(failed: Sequence[RequestResult]) -> dict[str, str]:
    firsts: dict[str, str] = {}
    for result in failed:
        firsts.setdefault(error_kind(result.error), result.error)
    return firsts


def error_lines(summary: dict) -> list[str]:
    """One line per kind of error: its count and its first message."""
    return [f"{count} x {summary['first_errors'][kind]}" for kind, count in summary["error_kinds"].items()]


@dataclass(slots=True)
class GoodputSearch:
    """The rates measured (rate, attainment), in order, and the bracket the search ended with."""

    target: float = ATTAINMENT_TARGET
    probes: list[tuple[float, float]] = field(default_factory=list)
    passing: float | None = None  # highest rate measured at or above the target (None: none)
    failing: float | None = None  # lowest rate measured below it (None: none failed)

    def record(self, rate: float, attainment: float) -> bool:
        self.probes.append((rate, attainment))
        ok = attainment >= self.target
        if ok:
            self.passing = rate if self.passing is None else max(self.passing, rate)
        else:
            self.failing = rate if self.failing is None else min(self.failing, rate)
        return ok

    def as_dict(self) -> dict:
        return {"goodput_req_s": self.passing, "first_failing_rate": self.failing, "target_attainment": self.target,
                "lower_bound_only": self.failing is None, "probes": self.probes}


def upward_rates(rates: Sequence[float], max_rate: float) -> Iterator[float]:
    """The given rates in ascending order, then doublings of the highest while they stay within `max_rate`."""
    ordered = sorted(rates)
    yield from ordered
    rate = ordered[-1] * 2
    while rate <= max_rate:
        yield rate
        rate *= 2


def find_goodput(measure: Callable[[float], float], rates: Sequence[float], bisect_steps: int,
                 target: float = ATTAINMENT_TARGET, max_rate: float = DEFAULT_MAX_RATE) -> GoodputSearch:
    """Measure `upward_rates` up to the first that misses `target`, then bisect `bisect_steps` times between the
    last passing rate and the first failing one. When the lowest rate already fails, the search stops there: the
    goodput lies below it. `measure(rate)` returns the attainment."""
    search = GoodputSearch(target)
    for rate in upward_rates(rates, max_rate):
        if not search.record(rate, measure(rate)):
            break
    for _ in range(bisect_steps if search.passing is not None and search.failing is not None else 0):
        search.record(mid := (search.passing + search.failing) / 2, measure(mid))
    return search
