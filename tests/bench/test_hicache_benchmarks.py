"""The host KV tier's benchmarks as users run them, on CPU with a tiny model: the copy microbenchmark and the
multi-turn script with the tiers off and on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cluster_util import CHILD_ENV
from test_bench_end_to_end import PNG_MAGIC, run_module

from pdserve.mem_cache.host_pool import MEM_LAYOUTS

REPO = Path(__file__).resolve().parents[2]


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


def test_ttft_benchmark_loads_the_whole_prefix_from_the_host_and_times_its_copies(tiny_models, tmp_path):
    out = tmp_path / "ttft.json"
    done = run_module("pdserve.bench.hicache", "--model-path", tiny_models["llama-tiny"], "--input-len", "200",
                      "--repeats", "2", "--warmup", "0", "--device", "cpu", "--dtype", "float32", "--page-size", "16",
                      "--out", str(out), timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    page_nbytes = 2 * 2 * 16 * 2 * 32 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads of 32 fp32
    for run in result["tiers"]["host"]["runs"]:
        assert run["loaded_bytes"] == 200 // 16 * page_nbytes and run["load_copy_ms"] > 0
    assert all(run["loaded_bytes"] == 0 for run in result["tiers"]["recompute"]["runs"])
    assert result["host_load_gbps"] > 0 and result["copy_ceiling_gbps"] > 0


def test_copy_benchmark_refuses_an_unknown_layout(tiny_model):
    done = run_module("pdserve.bench.hicache_copy", "--model-path", tiny_model, "--layouts", "page_head", timeout=60)
    assert done.returncode == 2 and "--layouts takes page_first, layer_first" in done.stderr


def test_multiturn_script_compares_tiers_off_and_host_tier_end_to_end(tiny_models, tmp_path):
    done = subprocess.run([sys.executable, "scripts/hicache_multiturn.py", "--device", "cpu", "--model-path",
                           tiny_models["llama-tiny"], "--sessions", "6", "--turns", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240, env=CHILD_ENV, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "multiturn.json").read_text())
    off, host = result["configs"]["tiers_off"], result["configs"]["host_tier"]
    # six sessions' turn-0 pages alone exceed the 640-token pool: session 0's history is evicted before its turn 1
    assert result["history_tokens"] > result["workload"]["max_total_tokens"]
    for config in (off, host):
        assert (config["completed"], config["errors"]) == (12, 0)
        assert config["ttft_ms"]["mean"] > 0 and config["request_throughput"] > 0
    assert off["server"]["host_hit_tokens"] == 0 and off["server"]["hicache_host_total_tokens"] is None
    assert host["server"]["host_hit_tokens"] > 0 and host["server"]["host_loaded_bytes"] > 0
    assert host["server"]["prefix_hit_fraction"] > off["server"]["prefix_hit_fraction"]
    assert set(result["comparison"]) >= {"ttft_mean_speedup", "request_throughput_gain", "host_tier_beats_tiers_off"}
    assert (tmp_path / "multiturn.png").read_bytes().startswith(PNG_MAGIC)


def test_multiturn_script_fails_clearly_when_a_server_cannot_start(tiny_models, tmp_path):
    done = subprocess.run([sys.executable, "scripts/hicache_multiturn.py", "--device", "cpu", "--model-path",
                           tiny_models["llama-tiny"], "--server-args", "--hicache-mem-layout page_head",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120, env=CHILD_ENV, cwd=REPO)
    assert done.returncode == 1
    assert "FAILED: tiers_off" in done.stdout and "--hicache-mem-layout" in done.stdout
    assert not (tmp_path / "multiturn.json").exists()
