"""Prometheus metrics, rendered by hand in the text exposition format (version 0.0.4)."""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Any

from pdserve.mem_cache.stats import METRIC_HELP

PREFIX = "pdserve_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name = PREFIX + name
        self.help_text = help_text
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last: above every bucket
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {self.sum}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


class ServerMetrics:
    def __init__(self) -> None:
        self.requests_received = 0
        self.requests_rejected = 0
        self.finished_by_reason: Counter[str] = Counter()
        self.http_errors: Counter[int] = Counter()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.inter_token = Histogram("inter_token_latency_seconds", "Time between output tokens.", LATENCY_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "Request latency, arrival to last token.", E2E_BUCKETS)

    def request_started(self) -> None:
        self.requests_received += 1

    def request_rejected(self) -> None:
        self.requests_rejected += 1

    def http_error(self, status: int) -> None:
        self.http_errors[status] += 1

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_inter_token(self, seconds: float, times: int) -> None:
        self.inter_token.observe(seconds, times)

    def request_finished(self, out: Any, e2e_seconds: float) -> None:
        self.finished_by_reason[out.finish_reason.get("type", "unknown")] += 1
        self.prompt_tokens += out.prompt_tokens
        self.generation_tokens += out.completion_tokens
        self.cached_tokens += out.cached_tokens
        self.e2e.observe(e2e_seconds)

    def render(self, stats: dict, in_flight: int) -> str:
        lines: list[str] = []
        _metric(lines, "requests_received_total", "counter", "Generation requests submitted.", self.requests_received)
        _metric(lines, "requests_rejected_total", "counter", "Requests the scheduler refused.", self.requests_rejected)
        reasons = self.finished_by_reason or Counter({"stop": 0})
        _labelled(lines, "requests_finished_total", "counter", "Finished requests.", "finish_reason", reasons)
        _labelled(lines, "http_errors_total", "counter", "HTTP error responses.", "status", self.http_errors)
        _metric(lines, "prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens)
        _metric(lines, "generation_tokens_total", "counter", "Generated tokens.", self.generation_tokens)
        _metric(lines, "cached_tokens_total", "counter", "Prompt tokens served from the prefix cache.", self.cached_tokens)
        for histogram in (self.ttft, self.inter_token, self.e2e):
            lines.extend(histogram.render())
        _metric(lines, "requests_in_flight", "gauge", "Requests the HTTP server is waiting on.", in_flight)
        lines.extend(_scheduler_gauges(stats))
        return "\n".join(lines) + "\n"


def _scheduler_gauges(stats: dict) -> list[str]:
    lines: list[str] = []
    used, total = stats.get("kv_used_tokens", 0), stats.get("kv_total_tokens", 0)
    hit, query = stats.get("prefix_hit_tokens", 0), stats.get("prefix_query_tokens", 0)
    _metric(lines, "num_running_reqs", "gauge", "Requests in the running batch.", stats.get("num_running", 0))
    _metric(lines, "num_queue_reqs", "gauge", "Requests waiting for admission.", stats.get("num_waiting", 0))
    _metric(lines, "kv_cache_used_tokens", "gauge", "KV-cache token slots in use.", used)
    _metric(lines, "kv_cache_total_tokens", "gauge", "KV-cache token slots.", total)
    _metric(lines, "kv_cache_usage_ratio", "gauge", "Fraction of the KV cache in use.", used / total if total else 0.0)
    _metric(lines, "prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache.", hit)
    _metric(lines, "prefix_cache_query_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.", query)
    _metric(lines, "prefix_cache_hit_rate", "gauge", "Prefix-cache hit tokens / looked-up tokens.", hit / query if query else 0.0)
    for name, per_tier in stats.get("hicache", {}).items():  # counters of the hierarchical cache, by tier
        _labelled(lines, name.removeprefix(PREFIX), "counter", METRIC_HELP[name], "tier", Counter(per_tier))
    return lines


def _metric(lines: list[str], name: str, kind: str, help_text: str, value: float) -> None:
    full = PREFIX + name
    lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}", f"{full} {value}"]


def _labelled(lines: list[str], name: str, kind: str, help_text: str, label: str, values: Counter) -> None:
    full = PREFIX + name
    lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
    lines += [f'{full}{{{label}="{key}"}} {count}' for key, count in sorted(values.items(), key=str)]
