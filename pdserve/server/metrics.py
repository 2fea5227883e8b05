"""The server's Prometheus metrics (prometheus-client, one registry per server process).

Request counters and latency histograms are updated as requests move; the scheduler's gauges are read from its
stats at each scrape. SGLang's production names (`sglang:*`, labelled `model_name`) are exported beside pdserve's own
for the dashboards that query them: the same families, renamed at each scrape, nothing counted twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from pdserve.mem_cache.stats import METRIC_HELP

PREFIX = "pdserve_"
SGLANG_PREFIX = "sglang:"
SGLANG_NAMES = {  # pdserve's family -> SGLang's (scheduler and tokenizer-manager metrics of SGLang's /metrics)
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "num_running_reqs": "num_running_reqs",
    "num_queue_reqs": "num_queue_reqs",
    "kv_cache_usage_ratio": "token_usage",
    "prefix_cache_hit_rate": "cache_hit_rate",
    "time_to_first_token_seconds": "time_to_first_token_seconds",
    "inter_token_latency_seconds": "inter_token_latency_seconds",
    "e2e_request_latency_seconds": "e2e_request_latency_seconds",
    "decode_tokens_per_second": "gen_throughput",
}
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

disable_created_metrics()  # no `_created` series: counters and histograms read as in SGLang's /metrics


class _ScrapeState:
    """The values read at scrape time: the scheduler's stats and the HTTP server's requests in flight."""

    def __init__(self) -> None:
        self.stats: dict = {}
        self.in_flight = 0

    def collect(self) -> list[Metric]:
        stats = self.stats
        used, total = stats.get("kv_used_tokens", 0), stats.get("kv_total_tokens", 0)
        hit, query = stats.get("prefix_hit_tokens", 0), stats.get("prefix_query_tokens", 0)
        return [
            _gauge("requests_in_flight", "Requests the HTTP server is waiting on.", self.in_flight),
            _gauge("num_running_reqs", "Requests in the running batch.", stats.get("num_running", 0)),
            _gauge("num_queue_reqs", "Requests waiting for admission.", stats.get("num_waiting", 0)),
            _gauge("decode_tokens_per_second", "Tokens the decoding requests generate per second at the measured "
                   "decode step time.", _decode_tokens_per_second(stats)),
            _gauge("kv_cache_used_tokens", "KV-cache token slots in use.", used),
            _gauge("kv_cache_total_tokens", "KV-cache token slots.", total),
            _gauge("kv_cache_usage_ratio", "Fraction of the KV cache in use.", used / total if total else 0.0),
            CounterMetricFamily(PREFIX + "prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.", hit),
            CounterMetricFamily(PREFIX + "prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache.",
                                query),
            _gauge("prefix_cache_hit_rate", "Prefix-cache hit tokens / looked-up tokens.", hit / query if query else 0.0),
            CounterMetricFamily(PREFIX + "compiles_after_ready", "Kernels compiled (or loaded from the on-disk cache) "
                                "after the server reported ready: variants the warm-up missed.",
                                stats.get("compiles_after_ready", 0)),
            *_grammar_metrics(stats),
            *_hicache_counters(stats.get("hicache", {})),
            *_kv_transfer_metrics(stats.get("kv_transfer")),
            *_receive_staging_metrics(stats.get("receive_staging")),
        ]


def _decode_tokens_per_second(stats: dict) -> float:
    step_ms = stats.get("decode_step_ms", 0.0)
    return stats.get("num_running_reqs", 0) * 1000 / step_ms if step_ms else 0.0


def _grammar_metrics(stats: dict) -> list[Metric]:
    """Structured output: requests with a grammar, compiles and their time, cache hits, masked rows, waiting ones."""
    counters = {
        "constrained_requests": "Requests that asked for a grammar (json_schema, regex, ebnf, ...).",
        "grammar_compiles": "Grammars compiled (one per distinct grammar; the others hit the cache).",
        "grammar_cache_hits": "Grammar requests served by an already compiled (or compiling) grammar.",
        "grammar_compile_seconds": "Time spent compiling grammars, in seconds.",
        "grammar_masked_rows": "Sampled rows whose logits a grammar's token bitmask masked.",
        "grammar_masked_steps": "Sampling steps that masked any row (masked rows per step: rows / steps).",
    }
    families: list[Metric] = [CounterMetricFamily(PREFIX + name, text, stats.get(name, 0))
                              for name, text in counters.items()]
    families.append(_gauge("grammar_waiting_reqs", "Requests waiting for their grammar's compile.",
                           stats.get("grammar_waiting", 0)))
    return families


def _hicache_counters(counters: dict[str, dict[str, float]]) -> list[Metric]:
    """The hierarchical cache's counters, one family per name with a `tier` label."""
    families = []
    for name, per_tier in counters.items():
        family = CounterMetricFamily(name, METRIC_HELP[name], labels=["tier"])
        for tier, value in per_tier.items():
            family.add_metric([tier], value)
        families.append(family)
    return families


def _kv_transfer_metrics(transfer: dict | None) -> list[Metric]:
    """A PD role's KV-transfer families (`role` label: prefill or decode); a colocated server has none."""
    if transfer is None:
        return []
    role = [transfer["role"]]
    moved = CounterMetricFamily(PREFIX + "kv_transfer_bytes", "KV-cache bytes handed over to or from the peer.",
                                labels=["role"])
    moved.add_metric(role, transfer["bytes"])
    done = CounterMetricFamily(PREFIX + "kv_transfers", "Requests whose KV handoff completed.", labels=["role"])
    done.add_metric(role, transfer["transfers"])
    duration = HistogramMetricFamily(
        PREFIX + "kv_transfer_duration_seconds",
        "Transfer time of one request's KV (prefill: its writes; decode: page ids sent to first token received).",
        labels=["role"])
    duration.add_metric(role, [(_le(le), n) for le, n in transfer["duration_buckets"]], transfer["duration_sum"])
    failures = CounterMetricFamily(PREFIX + "kv_transfer_failures", "KV handoffs that failed, by reason.",
                                   labels=["role", "reason"])
    for reason, n in sorted(transfer["failures"].items()):
        failures.add_metric([*role, reason], n)
    queues = GaugeMetricFamily(PREFIX + "pd_queue_requests",
                               "PD requests in the handshake (bootstrap) or waiting for their KV (transfer).",
                               labels=["role", "queue"])
    for queue, n in sorted(transfer["queues"].items()):
        queues.add_metric([*role, queue], n)
    return [moved, done, duration, failures, queues, *_link_metrics(role, transfer)]


def _link_metrics(role: list[str], transfer: dict) -> list[Metric]:
    """The prefill's write time, and the share of --disaggregation-link-gbps its writes reached (where set)."""
    write_time = CounterMetricFamily(
        PREFIX + "kv_transfer_write_seconds",
        "Time the prefill's transfer engine spent writing KV (bytes over it: the write rate).", labels=["role"])
    write_time.add_metric(role, transfer["write_seconds"])
    if transfer["link_efficiency"] is None:
        return [write_time]
    efficiency = GaugeMetricFamily(
        PREFIX + "kv_transfer_link_efficiency",
        "KV bytes written over write time, as a share of --disaggregation-link-gbps, since the server started.",
        labels=["role"])
    efficiency.add_metric(role, transfer["link_efficiency"])
    return [write_time, efficiency]


def _receive_staging_metrics(staging: dict | None) -> list[Metric]:
    """A decode's receive staging (`--disaggregation-staging-mb`): none without one."""
    if staging is None:
        return []
    return [
        CounterMetricFamily(PREFIX + "kv_receive_staged", "Handoffs whose KV landed in the decode's receive staging "
                            "and was unpacked into their pages.", staging["staged"]),
        CounterMetricFamily(PREFIX + "kv_receive_staged_scattered", "Staged handoffs whose pages on the decode were "
                            "not one run (each run would have cost a span per layer and K/V unstaged).",
                            staging["scattered"]),
        CounterMetricFamily(PREFIX + "kv_receive_staging_missed", "Handoffs offered a receive-staging slot that had "
                            "none before their prefill's writes began, and were written into their pages.",
                            staging["missed"]),
        CounterMetricFamily(PREFIX + "kv_receive_staging_late", "Missed handoffs whose slot was given after their "
                            "prefill's writes began (it came free unused).", staging["late"]),
        _gauge("kv_receive_staging_slots", "Receive-staging slots held by handoffs in flight or fenced.",
               staging["slots"]),
        _gauge("kv_receive_staging_bytes", "Size of the decode's receive staging.", staging["bytes"]),
    ]


class _SglangView:
    """The families of SGLANG_NAMES under SGLang's names, each sample labelled `model_name`; read from the same
    collectors at each scrape."""

    def __init__(self, model_name: str, sources: list[Any]):
        self.model_name = model_name
        self.sources = sources  # collectors whose families include every one SGLANG_NAMES renames

    def collect(self) -> Iterator[Metric]:
        for source in self.sources:
            for family in source.collect():
                name = SGLANG_NAMES.get(family.name.removeprefix(PREFIX))
                if name is not None:
                    yield self._renamed(family, SGLANG_PREFIX + name)

    def _renamed(self, family: Metric, name: str) -> Metric:
        renamed = Metric(name, family.documentation, family.type)
        for sample in family.samples:
            renamed.add_sample(name + sample.name.removeprefix(family.name),
                               {"model_name": self.model_name, **sample.labels}, sample.value)
        return renamed


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, help_text, value=value)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        """`model_name`: the served model name, SGLang's `model_name` label."""
        self.registry = CollectorRegistry(auto_describe=False)
        self._scrape = _ScrapeState()

        def counter(name: str, help_text: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, help_text, labels, registry=self.registry)

        self.requests_received = counter("requests_received", "Generation requests submitted.")
        self.requests_rejected = counter("requests_rejected", "Requests the scheduler refused.")
        self.finished = counter("requests_finished", "Finished requests.", ("finish_reason",))
        self.finished.labels(finish_reason="stop")  # the family shows a sample before the first request ends
        self.http_errors = counter("http_errors", "HTTP error responses.", ("status",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the prefix cache.")
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens.",
                                     buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             buckets=E2E_BUCKETS, registry=self.registry)
        self.registry.register(self._scrape)
        self.registry.register(_SglangView(model_name, [self.prompt_tokens, self.generation_tokens, self.ttft,
                                                        self.inter_token, self.e2e, self._scrape]))

    def request_started(self) -> None:
        self.requests_received.inc()

    def request_rejected(self) -> None:
        self.requests_rejected.inc()

    def http_error(self, status: int) -> None:
        self.http_errors.labels(status=str(status)).inc()

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_inter_token(self, seconds: float, times: int) -> None:
        for _ in range(times):
            self.inter_token.observe(seconds)

    def request_finished(self, out: Any, e2e_seconds: float) -> None:
        self.finished.labels(finish_reason=out.finish_reason.get("type", "unknown")).inc()
        self.prompt_tokens.inc(out.prompt_tokens)
        self.generation_tokens.inc(out.completion_tokens)
        self.cached_tokens.inc(out.cached_tokens)
        self.e2e.observe(e2e_seconds)

    def render(self, stats: dict, in_flight: int) -> str:
        """The text exposition, with the scheduler's `stats` and the requests `in_flight` as of now."""
        self._scrape.stats, self._scrape.in_flight = stats, in_flight
        return generate_latest(self.registry).decode()
