"""The page allocator hands out pages in as few ascending runs as the free space allows, however churned the pool.

A KV transfer moves one span per run, layer and K/V, so runs are what keeps a handoff fast after the pools fill.
"""

from __future__ import annotations

import random

import pytest

from pdserve.disagg.transfer.base import coalesce_page_runs
from pdserve.mem_cache.kv_pool import PageAllocator


def runs_of(pages: list[int]) -> int:
    return len(coalesce_page_runs(pages, pages))


def test_a_fresh_pool_gives_one_ascending_run_and_never_page_zero():
    allocator = PageAllocator(100)
    pages = allocator.alloc(40)
    assert pages == list(range(1, 41))
    assert allocator.alloc(60) is None  # only 99 pages are allocatable
    assert 0 not in allocator.alloc(59)
    assert allocator.num_free == 0


def test_freed_neighbours_merge_back_into_one_run():
    allocator = PageAllocator(65)
    pages = allocator.alloc(64)
    shuffled = pages[:]
    random.Random(0).shuffle(shuffled)
    for i in range(0, 64, 4):  # freed in scattered order, a few at a time
        allocator.free(shuffled[i:i + 4])
    assert allocator.num_free_runs == 1
    assert allocator.alloc(64) == list(range(1, 65))


def test_an_allocation_takes_the_first_run_that_holds_it_whole():
    allocator = PageAllocator(101)
    pages = allocator.alloc(100)
    allocator.free(pages[10:13])  # a 3-page hole at 11..13
    allocator.free(pages[50:70])  # a 20-page hole at 51..70
    assert allocator.alloc(8) == list(range(51, 59))
    assert allocator.alloc(3) == [11, 12, 13]


def test_without_a_run_that_fits_the_longest_runs_go_first_in_address_order():
    allocator = PageAllocator(101)
    pages = allocator.alloc(100)
    allocator.free(pages[0:2] + pages[10:16] + pages[40:50])  # runs of 2, 6 and 10 pages
    got = allocator.alloc(14)
    assert runs_of(got) == 2
    assert got == list(range(11, 17)) + list(range(41, 49))


def test_decode_style_churn_keeps_prompts_in_one_run():
    """Prompts allocated whole, growth pages one at a time interleaved across requests, finishes in random order:
    the free list of a stack allocator turns into a checkerboard (~240 runs per prompt here); free runs stay
    long (~2)."""
    rng = random.Random(1)
    allocator = PageAllocator(7500)
    running: list[list] = []
    prompt_runs = []
    for _ in range(20000):
        if rng.random() < 0.3:
            prompt = allocator.alloc(rng.randint(8, 500))
            if prompt is not None:
                prompt_runs.append(runs_of(prompt))
                running.append([prompt, rng.randint(0, 30)])
        for req in running:
            if req[1] > 0 and rng.random() < 0.2 and (page := allocator.alloc(1)):
                req[0].extend(page)
                req[1] -= 1
        finished = [req for req in running if req[1] == 0 and rng.random() < 0.05]
        for req in finished:
            allocator.free(req[0])
            running.remove(req)
    late = prompt_runs[-500:]
    assert sum(late) / len(late) < 3, f"mean runs per prompt {sum(late) / len(late):.1f}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pages_are_never_handed_out_twice_and_counts_stay_exact(seed):
    rng = random.Random(seed)
    allocator = PageAllocator(300)
    held: list[list[int]] = []
    owned: set[int] = set()
    for _ in range(3000):
        if held and rng.random() < 0.45:
            pages = held.pop(rng.randrange(len(held)))
            allocator.free(pages)
            owned.difference_update(pages)
        else:
            want = rng.randint(1, 40)
            pages = allocator.alloc(want)
            if pages is None:
                assert want > 299 - len(owned)
                continue
            assert len(pages) == want and not owned.intersection(pages) and 0 not in pages
            owned.update(pages)
            held.append(pages)
        assert allocator.num_free == 299 - len(owned)
    for pages in held:
        allocator.free(pages)
    assert allocator.num_free == 299 and allocator.num_free_runs == 1
