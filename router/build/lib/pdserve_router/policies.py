"""Load-balancing policies. Each picks one worker out of a non-empty list of available ones."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from .config import RouterConfig
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
    """Sends a request to the worker that most recently served its longest known prefix.

    The prefix index maps chained hashes of `block`-sized prefix blocks to the worker they were routed to
    (bounded LRU). A match covering at least `cache_threshold` of the key wins; otherwise, or when the load is
    imbalanced (max - min in-flight > abs threshold and max > rel threshold * min), the least loaded worker wins.
    """

    def __init__(self, config: RouterConfig):
        self.block = config.cache_block_chars
        self.threshold = config.cache_threshold
        self.abs_threshold = config.balance_abs_threshold
        self.rel_threshold = config.balance_rel_threshold
        self.max_entries = config.cache_max_entries
        self.owner: OrderedDict[int, str] = OrderedDict()

    def select(self, workers: Sequence[Worker], key: RoutingKey | None) -> Worker:
        least = min(workers, key=lambda w: (w.in_flight, random.random()))
        if not key:
            return least
        hashes = self.block_hashes(key)
        chosen = least if self.imbalanced(workers) else self.cached_owner(workers, hashes, len(key)) or least
        for h in hashes:
            self.owner[h] = chosen.url
            self.owner.move_to_end(h)
        while len(self.owner) > self.max_entries:
            self.owner.popitem(last=False)
        return chosen

    def block_hashes(self, key: RoutingKey) -> list[int]:
        hashes, h = [], 0
        for start in range(0, len(key), self.block):
            chunk = key[start:start + self.block]
            h = hash((h, chunk if isinstance(chunk, str) else tuple(chunk)))
            hashes.append(h)
        return hashes

    def cached_owner(self, workers: Sequence[Worker], hashes: list[int], key_len: int) -> Worker | None:
        by_url = {w.url: w for w in workers}
        for n_blocks in range(len(hashes), 0, -1):
            worker = by_url.get(self.owner.get(hashes[n_blocks - 1], ""))
            if worker is not None:
                matched = min(n_blocks * self.block, key_len)
                return worker if matched / key_len >= self.threshold else None
        return None

    def imbalanced(self, workers: Sequence[Worker]) -> bool:
        loads = [w.in_flight for w in workers]
        return max(loads) - min(loads) > self.abs_threshold and max(loads) > self.rel_threshold * min(loads)


def make_policy(name: str, config: RouterConfig) -> Policy:
    if name == "cache_aware":
        return CacheAwarePolicy(config)
    return {"random": RandomPolicy, "round_robin": RoundRobinPolicy, "least_load": LeastLoadPolicy}[name]()
