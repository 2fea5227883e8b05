"""Statistics of a run (SGLang bench_serving's definitions) and the goodput search.

- TTFT: send to first token. E2E: send to last token. TPOT of a request: (E2E - TTFT) / (output tokens - 1),
  for requests with two or more tokens. ITL: every gap between token arrivals, over all requests (a chunk of
  k tokens counts k gaps of gap / k).
- SLO attainment: the fraction of requests (errors included, client aborts excluded) that succeeded with
  TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms. Goodput: the highest request rate whose attainment is at
  least the target (90%), found by a sweep and bisection (`find_goodput`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.bench.client import RequestResult

PERCENTILES = (50, 90, 99)
ATTAINMENT_TARGET = 0.9
ERROR_EXAMPLES = 10


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

    def met(self, result: RequestResult) -> bool:
        if not result.success:
            return False
        if self.ttft_ms is not None and result.ttft * 1000.0 > self.ttft_ms:
            return False
        tpot = result.tpot
        return self.tpot_ms is None or tpot is None or tpot * 1000.0 <= self.tpot_ms


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
        "good_request_throughput": good / duration_s,
    }


def error_kind(error: str) -> str:
    """The leading words of an error ("HTTP 503", "timeout", "ClientPayloadError", ...) for counting."""
    return error.split(":", 1)[0].strip() or "unknown"


@dataclass(slots=True)
class GoodputSearch:
    """The rates measured (rate, attainment), in order, and the bracket the search ended with."""

    target: float = ATTAINMENT_TARGET
    probes: list[tuple[float, float]] = field(default_factory=list)
    passing: float = 0.0  # highest rate measured at or above the target (0: none)
    failing: float | None = None  # lowest rate measured below it (None: none failed)

    def record(self, rate: float, attainment: float) -> bool:
        self.probes.append((rate, attainment))
        ok = attainment >= self.target
        if ok:
            self.passing = max(self.passing, rate)
        else:
            self.failing = rate if self.failing is None else min(self.failing, rate)
        return ok

    def as_dict(self) -> dict:
        return {"goodput_req_s": self.passing, "first_failing_rate": self.failing, "target_attainment": self.target,
                "lower_bound_only": self.failing is None, "probes": self.probes}


def find_goodput(measure: Callable[[float], float], rates: Sequence[float], bisect_steps: int,
                 target: float = ATTAINMENT_TARGET) -> GoodputSearch:
    """Measure `rates` in ascending order up to the first that misses `target`, then bisect `bisect_steps` times
    between the last passing rate (0 if none) and the first failing one. `measure(rate)` returns the attainment."""
    search = GoodputSearch(target)
    for rate in sorted(rates):
        if not search.record(rate, measure(rate)):
            break
    for _ in range(bisect_steps if search.failing is not None else 0):
        search.record(mid := (search.passing + search.failing) / 2, measure(mid))
    return search
