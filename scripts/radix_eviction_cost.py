"""Host time of the radix cache's per-admission work with a full pool: the evictable count and an eviction, next
to one walk of the tree (what both cost when they walked it). An H200 holds ~50k pages of llama-3.1-8b KV
(16-token pages), and a prefill server's pool fills with cached prefixes under load.

    python scripts/radix_eviction_cost.py --pages 50000
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pdserve.mem_cache.kv_pool import PageAllocator
from pdserve.mem_cache.radix_cache import RadixCache


def fill(pages: int, page_size: int, pages_per_prompt: int) -> RadixCache:
    allocator = PageAllocator(pages + 1)
    radix = RadixCache(allocator, page_size)
    rng = random.Random(0)
    for _ in range(pages // pages_per_prompt):
        ids = [rng.randrange(32000) for _ in range(pages_per_prompt * page_size)]
        held = allocator.alloc(pages_per_prompt)
        radix.insert(ids, held)
        allocator.free(held)
    return radix


def median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=50_000)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--pages-per-prompt", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    radix = fill(args.pages, args.page_size, args.pages_per_prompt)
    walk = median_us(lambda: sum(1 for _ in radix._nodes()), args.repeats)
    count = median_us(radix.evictable_pages, args.repeats)
    evict = median_us(lambda: radix.evict(4), args.repeats)
    print(f"{radix.num_pages} cached pages: evictable count {count:.1f} µs, evict 4 pages {evict:.1f} µs; "
          f"one walk of the tree {walk:.0f} µs")


if __name__ == "__main__":
    main()
