"""The host KV tier's benchmarks as users run them: the copy microbenchmark on CPU with a tiny model."""

from __future__ import annotations

import json

from test_bench_end_to_end import PNG_MAGIC, run_module

from pdserve.mem_cache.host_pool import MEM_LAYOUTS


def test_copy_benchmark_measures_every_layout_and_loads_back_what_it_stored(tiny_model, tmp_path):
    out, png = tmp_path / "copy.json", tmp_path / "copy.png"
    done = run_module("pdserve.bench.hicache_copy", "--model-path", tiny_model, "--device", "cpu", "--tokens", "512",
                      "--page-size", "16", "--repeats", "2", "--out", str(out), "--plot", str(png), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["pages"] == 32 and result["bytes"] == 32 * result["page_nbytes"] > 0
    assert result["ceilings"]["h2d_gbps"] > 0 and result["ceilings"]["d2h_gbps"] > 0
    cases = {(c["mem_layout"], c["host_pages"]): c for c in result["cases"]}
    assert set(cases) == {(layout, order) for layout in MEM_LAYOUTS for order in ("contiguous", "scattered")}
    for case in cases.values():
        assert case["pages_stored"] == case["pages_loaded"] == case["pages_verified"] == 32
        assert case["load_gbps"] > 0 and case["backup_gbps"] > 0 and case["load_fraction"] > 0
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert "32/32 pages verified" in done.stdout


def test_copy_benchmark_refuses_an_unknown_layout(tiny_model):
    done = run_module("pdserve.bench.hicache_copy", "--model-path", tiny_model, "--layouts", "page_head", timeout=60)
    assert done.returncode == 2 and "--layouts takes page_first, layer_first" in done.stderr
