"""Load-balancing policies. Each picks one worker out of a non-empty list of available ones."""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from .config import RouterConfig
from .reported_cache import longest_reported
from .workers import Worker

RoutingKey = Sequence  # prompt text, or token ids; None when the request has neither


class Policy(Protocol):
    def select(self, workers: Sequence[Worker], key: RoutingKey | None) -> Worker: ...


class RandomPolicy:
    def select(self, workers: Sequence[Worker], key: RoutingKey | None) -> Worker:
        return random.choice(workers)


class RoundRobinPolicy:
    __slots__ = ("counter",)

    def __init__(self) -> None:
        self.counter = 0

    def select(self, workers: Sequence[Worker], key: RoutingKey | None) -> Worker:
        worker = workers[self.counter % len(workers)]
        self.counter += 1
        return worker


class LeastLoadPolicy:
    """Power of two choices on the router's live in-flight counts."""

    def select(self, workers: Sequence[Worker], key: RoutingKey | None) -> Worker:
        if len(workers) == 1:
            return workers[0]
        a, b = random.sample(workers, 2)
        return a if a.in_flight <= b.in_flight else b


class CacheAwarePolicy:
    """Sends a request to the worker that holds, or most recently served, its longest prefix.

    `--cache-aware-source` says where prefixes are known from. `local` (SGLang's router): the router's own index,
    chained hashes of `block`-sized prefix blocks mapped to the worker they were routed to (bounded LRU).
    `reported`: what the workers report holding (`reported_cache`, polled from their `/cache_report`; stale
    reports are ignored), which also knows prefixes cached by requests that did not pass through this router and
    forgets what the worker evicted. `both`: the longer match of the two, the report on a tie. A match covering at
    least `cache_threshold` of the key wins; otherwise, or when the load is imbalanced (max - min in-flight > abs
    threshold and max > rel threshold * min), the least loaded worker wins. `on_decision` gets what decided:
    `reported`, `local` or `load`.
    """

    def __init__(self, config: RouterConfig, on_decision: Callable[[str], None] | None = None):
        self.block = config.cache_block_chars
        self.threshold = config.cache_threshold
        self.abs_threshold = config.balance_abs_threshold
        self.rel_threshold = config.balance_rel_threshold
        self.max_entries = config.cache_max_entries
        self.source = config.cache_aware_source
        self.report_ttl_s = config.cache_report_ttl_s
        self.on_decision = on_decision or (lambda source: None)
        self.owner: OrderedDict[int, str] = OrderedDict()

    def select(self, workers: Sequence[Worker], key: RoutingKey | None) -> Worker:
        least = min(workers, key=lambda w: (w.in_flight, random.random()))
        chosen, source = least, "load"
        hashes = self.block_hashes(key) if key and self.source != "reported" else []
        if key and not self.imbalanced(workers):
            chosen, source = self.best_match(workers, key, hashes) or (least, "load")
        if hashes:
            self.remember(hashes, chosen)
        self.on_decision(source)
        return chosen

    def best_match(self, workers: Sequence[Worker], key: RoutingKey, hashes: list[int]) -> tuple[Worker, str] | None:
        """The worker holding the longest prefix of `key` and where that is known from, if it covers enough."""
        matches = []  # (matched length, the report first on a tie, worker, source)
        if self.source != "local":
            worker, matched = self.reported_match(workers, key)
            if worker is not None:
                matches.append((matched, 1, worker, "reported"))
        if self.source != "reported":
            worker, matched = self.cached_owner(workers, hashes, len(key))
            if worker is not None:
                matches.append((matched, 0, worker, "local"))
        if not matches:
            return None
        matched, _, worker, source = max(matches, key=lambda m: m[:2])
        return (worker, source) if matched / len(key) >= self.threshold else None

    def reported_match(self, workers: Sequence[Worker], key: RoutingKey) -> tuple[Worker | None, int]:
        fresh_after = time.monotonic() - self.report_ttl_s
        reports = {w.url: w.cache_report for w in workers
                   if w.cache_report is not None and w.cache_report.received_at >= fresh_after}
        found = longest_reported(reports, key)
        if found is None:
            return None, 0
        url, matched, _ = found
        return next(w for w in workers if w.url == url), matched

    def block_hashes(self, key: RoutingKey) -> list[int]:
        hashes, h = [], 0
        for start in range(0, len(key), self.block):
            chunk = key[start:start + self.block]
            h = hash((h, chunk if isinstance(chunk, str) else tuple(chunk)))
            hashes.append(h)
        return hashes

    def remember(self, hashes: list[int], worker: Worker) -> None:
        for h in hashes:
            self.owner[h] = worker.url
            self.owner.move_to_end(h)
        while len(self.owner) > self.max_entries:
            self.owner.popitem(last=False)

    def cached_owner(self, workers: Sequence[Worker], hashes: list[int], key_len: int) -> tuple[Worker | None, int]:
        """The worker this router last sent the key's longest known prefix to, and that prefix's length."""
        by_url = {w.url: w for w in workers}
        for n_blocks in range(len(hashes), 0, -1):
            worker = by_url.get(self.owner.get(hashes[n_blocks - 1], ""))
            if worker is not None:
                return worker, min(n_blocks * self.block, key_len)
        return None, 0

    def imbalanced(self, workers: Sequence[Worker]) -> bool:
        loads = [w.in_flight for w in workers]
        return max(loads) - min(loads) > self.abs_threshold and max(loads) > self.rel_threshold * min(loads)


def make_policy(name: str, config: RouterConfig, on_decision: Callable[[str], None] | None = None) -> Policy:
    if name == "cache_aware":
        return CacheAwarePolicy(config, on_decision)
    return {"random": RandomPolicy, "round_robin": RoundRobinPolicy, "least_load": LeastLoadPolicy}[name]()
