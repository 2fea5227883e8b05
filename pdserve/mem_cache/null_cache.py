"""The prefix cache of a server that caches nothing (`--disable-radix-cache`, the decode role by default).

It answers every `RadixCache` call the scheduler and the PD roles make, so that they hold a prefix cache
object whatever the flags say and never test for its absence: nothing matches, nothing is kept, nothing is
evictable, every count is zero.
"""

from __future__ import annotations


class NullPrefixCache:
    num_pages = 0
    query_tokens = 0
    hit_tokens = 0
    host_capacity_pages = 0
    __slots__ = ()

    def match_prefix(self, token_ids: list[int], max_tokens: int, rid: str | None = None) -> list[int]:
        return []

    def record_hit(self, query_tokens: int, hit_tokens: int) -> None:
        pass

    def reset_hit_counts(self) -> None:
        pass

    def insert(self, token_ids: list[int], pages: list[int]) -> None:
        pass

    def prefetch(self, rid: str, token_ids: list[int]) -> None:
        pass

    def wait_for_loads(self) -> None:
        pass

    def tier_stats(self) -> dict:
        return {}

    def evictable_pages(self) -> int:
        return 0

    def evict(self, num_pages: int) -> int:
        return 0

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass
