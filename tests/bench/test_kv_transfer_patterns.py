"""The page placements `pdserve.bench.kv_transfer` measures: what a fragmented case hands the transfer."""

from __future__ import annotations

import random

from pdserve.bench.kv_transfer import Case, build_parser, compacted, llama8b_layout, page_lists
from pdserve.disagg.transfer import coalesce_page_runs
from pdserve.disagg.transfer.packing import destination_runs


def test_compacting_a_page_list_keeps_its_runs_and_fits_the_benchmark_buffer():
    pages = [900, 901, 902, 17, 5000, 18, 19, 3]
    assert compacted(pages) == [7, 8, 9, 3, 11, 4, 5, 1]
    lengths = [n for _, _, n in coalesce_page_runs(pages, pages)]
    assert [n for _, _, n in coalesce_page_runs(compacted(pages), compacted(pages))] == lengths == [3, 1, 1, 2, 1]


def test_each_pattern_gives_distinct_pages_inside_the_buffer_in_as_many_runs_as_it_claims():
    args = build_parser().parse_args(["--tokens", "2048", "--traffic-pool-tokens", "40000"])
    rng = random.Random(0)
    layout = llama8b_layout(16, 2048)
    runs = {}
    for pattern in ("contiguous", "scattered", "scattered-source", "fragmented"):
        src, dst = page_lists(Case(pattern, 0, 16, 2048, pattern), 2048, args, rng)
        for side in (src, dst):
            assert len(side) == len(set(side)) == 128 and 1 <= min(side) and max(side) < layout.num_pages
        runs[pattern] = coalesce_page_runs(src, dst)
    assert len(runs["contiguous"]) == 1 and len(runs["scattered"]) > 100
    assert len(runs["scattered-source"]) > 100 and len(destination_runs(runs["scattered-source"])) == 1
    assert 1 <= len(destination_runs(runs["fragmented"])) <= len(runs["fragmented"]) < 128
