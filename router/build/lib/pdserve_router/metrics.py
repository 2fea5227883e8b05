"""Prometheus text exposition, written by hand (no prometheus_client dependency)."""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable

from .workers import Worker

PREFIX = "pdserve_router_"
LATENCY_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1, 0.5, 1.0)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    if not pairs:
        return ""
    escaped = (str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in pairs)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(pairs, escaped)) + "}"


class Counter:
    def __init__(self, name: str, help_text: str):
        self.name, self.help = PREFIX + name, help_text
        self.values: defaultdict[tuple, float] = defaultdict(float)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self.values[tuple(labels.items())] += amount

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}\n# TYPE {self.name} counter\n"
        for labels, value in self.values.items():
            yield f"{self.name}{_labels(labels)} {value:g}\n"


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = PREFIX + name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}\n# TYPE {self.name} histogram\n"
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            yield f'{self.name}_bucket{{le="{bound:g}"}} {cumulative}\n'
        cumulative += self.counts[-1]
        yield f'{self.name}_bucket{{le="+Inf"}} {cumulative}\n{self.name}_sum {self.sum:.6f}\n'
        yield f"{self.name}_count {cumulative}\n"


class RouterMetrics:
    def __init__(self) -> None:
        self.requests = Counter("requests_total", "Requests received, by route.")
        self.errors = Counter("errors_total", "Failures, by kind (connect, upstream_5xx, upstream_4xx, timeout, "
                                              "no_worker, bad_request, client_disconnect, stream).")
        self.retries = Counter("retries_total", "Attempts retried with a new pair.")
        self.aborts = Counter("aborts_total", "Abort requests sent to the other half of a failed pair, by role.")
        self.added_latency = Histogram("added_latency_seconds", "Time the router spends before dispatching a "
                                       "request plus before relaying the first upstream chunk.", LATENCY_BUCKETS)
        self.duration = Histogram("request_duration_seconds", "Whole request time as seen by the router.",
                                  DURATION_BUCKETS)

    def render(self, workers: Iterable[Worker]) -> str:
        parts = [line for metric in (self.requests, self.errors, self.retries, self.aborts, self.added_latency,
                                     self.duration) for line in metric.render()]
        workers = list(workers)
        for name, help_text, value in (("in_flight", "Requests in flight per instance.", lambda w: w.in_flight),
                                       ("worker_healthy", "1 when the instance is in rotation.",
                                        lambda w: int(w.healthy and w.breaker.state != "open"))):
            parts.append(f"# HELP {PREFIX}{name} {help_text}\n# TYPE {PREFIX}{name} gauge\n")
            parts.extend(f"{PREFIX}{name}{_labels((('url', w.url), ('role', w.role)))} {value(w)}\n" for w in workers)
        return "".join(parts)
