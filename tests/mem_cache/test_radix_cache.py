"""The radix cache's bookkeeping without tree walks: the evictable count and the LRU order of eviction agree with
a brute-force walk of the tree after any mix of inserts, matches, releases and evictions."""

from __future__ import annotations

import random

from pdserve.mem_cache.kv_pool import PageAllocator
from pdserve.mem_cache.radix_cache import RadixCache

PAGE = 2


def walk(radix: RadixCache):
    stack = list(radix.root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def brute_force_evictable(radix: RadixCache) -> int:
    return sum(1 for n in walk(radix) if radix.allocator.refcount(n.page) == 1)


def brute_force_lru_leaf(radix: RadixCache):
    leaves = [n for n in walk(radix) if not n.children and radix.allocator.refcount(n.page) == 1]
    return min(leaves, key=lambda n: n.last_access, default=None)


def test_counts_and_eviction_order_match_a_walk_of_the_tree():
    rng = random.Random(7)
    allocator = PageAllocator(200)
    radix = RadixCache(allocator, PAGE)
    held: list[list[int]] = []  # pages that "requests" still reference
    for _ in range(3000):
        op = rng.random()
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 12) * PAGE)]
        if op < 0.35:
            matched = radix.match_prefix(tokens, len(tokens))
            fresh = allocator.alloc(len(tokens) // PAGE - len(matched)) or []
            pages = matched + fresh
            radix.insert(tokens[: len(pages) * PAGE], pages)
            held.append(pages)
        elif op < 0.6 and held:
            allocator.free(held.pop(rng.randrange(len(held))))
        elif op < 0.7:
            held.append(radix.match_prefix(tokens, len(tokens)))
        else:
            expected = brute_force_lru_leaf(radix)
            freed = radix.evict(1)
            assert freed == (expected is not None)
            if expected is not None:
                assert expected.page == -1 and expected.key not in expected.parent.children
        assert radix.evictable_pages() == brute_force_evictable(radix)
        in_use = {n.page for n in walk(radix)} | {p for pages in held for p in pages}
        assert allocator.num_free + len(in_use) == allocator.capacity
    for pages in held:
        allocator.free(pages)
    cached = radix.num_pages
    assert cached > 0 and radix.evictable_pages() == cached
    assert radix.evict(cached + 5) == cached
    assert radix.num_pages == 0 and allocator.num_free == allocator.capacity and radix.evictable_pages() == 0


def test_a_prefix_in_use_is_never_evicted_and_its_parents_go_after_their_children():
    allocator = PageAllocator(10)
    radix = RadixCache(allocator, PAGE)
    pages = allocator.alloc(3)
    radix.insert([1, 1, 2, 2, 3, 3], pages)
    allocator.free(pages)
    in_use = radix.match_prefix([1, 1, 2, 2], 4)  # the first two pages are referenced again
    assert radix.evictable_pages() == 1
    assert radix.evict(3) == 1 and radix.num_pages == 2  # only the unreferenced leaf went
    allocator.free(in_use)
    assert radix.evictable_pages() == 2
    assert radix.evict(3) == 2 and allocator.num_free == allocator.capacity
