"""The server with --enable-hierarchical-cache: an evicted prefix comes back from the host tier through HTTP."""

from __future__ import annotations

import pytest
from cluster_util import scheduler_stats, server, start_all, wait_kv_free
from hicache_util import MAX_NEW, PAGE_SIZE, SMALL_POOL_TOKENS, prompts


@pytest.fixture(scope="module")
def tiered_server(tiny_model, tmp_path_factory):
    proc = server("hicache", tiny_model, "--max-total-tokens", str(SMALL_POOL_TOKENS), "--page-size", str(PAGE_SIZE),
                  "--enable-hierarchical-cache", "--hicache-ratio", "4", "--hicache-storage-backend", "file",
                  "--hicache-storage-dir", str(tmp_path_factory.mktemp("hicache")))
    start_all([proc])
    yield proc
    proc.stop()


def generate(proc, ids: list[int]) -> dict:
    reply = proc.post("/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}})
    assert reply.status == 200, reply.body
    return reply.json()


def test_evicted_prefix_is_served_from_host_through_http(tiered_server, hf_greedy):
    base, other1, other2 = prompts(64, 64, 64, seed=8)
    for ids in (base, other1, other2):
        generate(tiered_server, ids)
    followup = base + [21, 22]
    result = generate(tiered_server, followup)
    assert result["meta_info"]["cached_tokens"] == 64
    assert result["output_ids"] == hf_greedy(followup)
    stats = scheduler_stats(tiered_server)
    assert stats["hicache"]["pdserve_hicache_hit_tokens_total"]["host"] > 0
    assert stats["hicache"]["pdserve_hicache_backend_errors_total"]["storage"] == 0
    metrics = tiered_server.get("/metrics").body.decode()
    host_hits = next(line for line in metrics.splitlines() if line.startswith('pdserve_hicache_hit_tokens_total{tier="host"}'))
    assert float(host_hits.split()[-1]) == stats["hicache"]["pdserve_hicache_hit_tokens_total"]["host"]
    wait_kv_free([tiered_server])


def test_bad_hicache_flags_are_refused_at_start(tiny_model):
    proc = server("bad-hicache", tiny_model, "--hicache-storage-backend", "mooncake")
    proc.launch()
    assert proc.proc.wait(120) != 0
    assert "--enable-hierarchical-cache" in proc.log()
    proc.stop()
