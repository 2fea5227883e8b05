"""The router's Prometheus metrics (prometheus-client, one registry per router); the per-instance gauges are read
from the worker registry at each scrape."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from .workers import Worker

PREFIX = "pdserve_router_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1, 0.5, 1.0)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                 10.0, 30.0, 60.0, 120.0)  # pdserve.timeline's, so router and server stages read alike

disable_created_metrics()  # no `_created` series next to the counters and histograms


class _WorkerGauges:
    """Requests in flight and rotation state per instance, as of the scrape."""

    def __init__(self) -> None:
        self.workers: list[Worker] = []

    def collect(self) -> list[Metric]:
        in_flight = GaugeMetricFamily(PREFIX + "in_flight", "Requests in flight per instance.", labels=("url", "role"))
        healthy = GaugeMetricFamily(PREFIX + "worker_healthy", "1 when the instance is in rotation.",
                                    labels=("url", "role"))
        for worker in self.workers:
            labels = (worker.url, worker.role)
            in_flight.add_metric(labels, worker.in_flight)
            healthy.add_metric(labels, int(worker.in_rotation))
        return [in_flight, healthy]


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        registry = self.registry
        self.requests = Counter(PREFIX + "requests", "Requests received, by route.", ("route",), registry=registry)
        self.errors = Counter(PREFIX + "errors", "Failures, by kind (connect, upstream_5xx, upstream_4xx, timeout, "
                              "no_worker, bad_request, client_disconnect, stream, shutdown).", ("kind",), registry=registry)
        self.prefills = Counter(PREFIX + "prefill", "PD requests by where their prompt was prefilled: remote (a "
                                "prefill instance) or local (the decode instance, conditional disaggregation).",
                                ("path",), registry=registry)
        self.local_prefill_decisions = Counter(PREFIX + "local_prefill_decisions", "--local-prefill-by-load "
                                               "choices, by reason: local_faster, remote_faster, no_budget (no "
                                               "decode instance reports a local prefill rate), kv_gate (those that "
                                               "do are above the KV gate), prefill_unmeasured (a prefill instance "
                                               "has no measured rate).", ("reason",), registry=registry)
        self.predicted_ttft = Histogram(PREFIX + "predicted_ttft_seconds", "--local-prefill-by-load: the predicted "
                                        "time to first token of each path at each choice (local: the best decode "
                                        "instance's).", ("path",), buckets=STAGE_BUCKETS, registry=registry)
        self.learned_overhead = Gauge(PREFIX + "learned_overhead_seconds", "--local-prefill-by-load: each path's "
                                      "learned time to first token beyond its predicted wait (remote: the "
                                      "handoff).", ("path",), registry=registry)
        self.prompt_bytes_per_token = Gauge(PREFIX + "prompt_bytes_per_token", "--local-prefill-by-load: the UTF-8 "
                                            "bytes per token of text prompts, learned from the servers' counts "
                                            "(4 until one is seen).", registry=registry)
        self.cache_decisions = Counter(PREFIX + "cache_aware_decisions", "cache_aware picks, by role and by what "
                                       "decided: reported (an instance's /cache_report), local (the router's own "
                                       "prefix index) or load (no prefix matched enough, or the load was imbalanced).",
                                       ("role", "source"), registry=registry)
        self.role_switches = Counter(PREFIX + "role_switches", "Role switches asked of PD instances (--balance-roles "
                                     "or POST /pd_role_switch), by the role asked for and the outcome: switched, "
                                     "refused (the instance keeps its role), or followed (an instance found "
                                     "serving another role, registered again under it).", ("to_role", "outcome"),
                                     registry=registry)
        self.retries = Counter(PREFIX + "retries", "Attempts retried with a new pair.", registry=registry)
        self.aborts = Counter(PREFIX + "aborts", "Abort requests sent to the other half of a failed pair, by role.",
                              ("role",), registry=registry)
        self.added_latency = Histogram(PREFIX + "added_latency_seconds", "Time the router spends before dispatching a "
                                       "request plus before relaying the first upstream chunk.",
                                       buckets=LATENCY_BUCKETS, registry=registry)
        self.duration = Histogram(PREFIX + "request_duration_seconds", "Whole request time as seen by the router.",
                                  buckets=DURATION_BUCKETS, registry=registry)
        self.stages = Histogram(PREFIX + "request_stage_seconds", "Seconds from a request's arrival at the router "
                                "to each stage: dispatched to and first byte from each side, finished.", ("stage",),
                                buckets=STAGE_BUCKETS, registry=registry)
        self._workers = _WorkerGauges()
        registry.register(self._workers)

    def render(self, workers: Iterable[Worker]) -> str:
        self._workers.workers = list(workers)
        return generate_latest(self.registry).decode()
