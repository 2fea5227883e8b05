"""The serving benchmark and the soak as users run them (`python -m ...`), against a real tiny colocated server
and a tiny tcp PD pair behind the router."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cluster_util import CHILD_ENV, wait_kv_free

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL_MIX = ["--dataset", "mix", "--mix-input-scale", "0.04", "--mix-output-scale", "0.05"]


def run_module(module: str, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True,
                          text=True, timeout=timeout, env=CHILD_ENV)


def serving(*argv: str, returncode: int = 0) -> subprocess.CompletedProcess:
    done = run_module("pdserve.bench.serving", *argv, "--disable-progress")
    assert done.returncode == returncode, done.stdout + done.stderr
    return done


def check_run(run: dict, requests: int, rate: float) -> None:
    assert run["request_rate"] == rate
    assert (run["requests"], run["completed"], run["errors"]) == (requests, requests, 0), run["error_examples"]
    assert run["slo_attainment"] == 1.0
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        dist = run[metric]
        assert 0 < dist["p50"] <= dist["p90"] <= dist["p99"], (metric, dist)


def test_benchmark_against_a_colocated_server_has_exact_lengths_and_draws_a_plot(deployments, tiny_model, tmp_path):
    server = deployments["colocated"]
    out, png = tmp_path / "colocated.json", tmp_path / "colocated.png"
    serving("--backend", "pdserve", "--base-url", server.url, "--tokenizer", tiny_model, *SMALL_MIX,
            "--num-prompts", "12", "--request-rate", "6", "12", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000",
            "--output", str(out), "--output-details", "--plot", str(png))
    result = json.loads(out.read_text())
    assert result["warmup"]["completed"] == 2 and result["num_prompts"] == 12
    assert (result["model"], result["context_length"]) == (tiny_model, 512)
    assert [run["request_rate"] for run in result["runs"]] == [6, 12]
    for run in result["runs"]:
        check_run(run, 12, run["request_rate"])
        details = run["details"]
        assert [d["prompt_tokens"] for d in details] == [d["input_len"] for d in details]
        assert [d["output_len"] for d in details] == [d["expected_output_len"] for d in details]
        assert run["output_tokens"] == sum(d["expected_output_len"] for d in details)
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_goodput_sweep_through_the_pd_router_with_the_openai_backend(deployments, tiny_model, tmp_path):
    router = deployments["pd"].router
    out = tmp_path / "pd.json"
    done = serving("--backend", "openai", "--base-url", router.url, "--tokenizer", tiny_model, *SMALL_MIX,
                   "--num-prompts", "10", "--request-rate", "4", "8", "--sweep", "--slo-ttft-ms", "60000",
                   "--slo-tpot-ms", "60000", "--max-request-rate", "8", "--output", str(out), "--label", "pd")
    result = json.loads(out.read_text())
    assert [run["request_rate"] for run in result["runs"]] == [4, 8]
    for run in result["runs"]:
        check_run(run, 10, run["request_rate"])
    assert result["goodput"]["goodput_req_s"] == 8 and result["goodput"]["lower_bound_only"]
    assert "goodput >= 8 req/s" in done.stdout
    wait_kv_free(deployments["pd"].servers)


def test_plot_subcommand_draws_several_result_files_on_one_chart(tmp_path):
    paths = []
    for label, scale in (("a", 1.0), ("b", 2.0)):
        dist = {"mean": 10 * scale, "p50": 10 * scale, "p90": 20 * scale, "p99": 30 * scale}
        runs = [{"request_rate": rate, "slo_attainment": 1 / (rate * scale), "ttft_ms": dist, "tpot_ms": dist,
                 "itl_ms": dist, "e2e_ms": dist, "requests": 10, "errors": rate} for rate in (1, 2, 4)]
        paths.append(tmp_path / f"{label}.json")
        paths[-1].write_text(json.dumps({"label": label, "runs": runs}))
    png = tmp_path / "both.png"
    done = run_module("pdserve.bench.serving", "plot", *map(str, paths), "-o", str(png))
    assert done.returncode == 0, done.stderr
    assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 10_000


BAD_TEMPERATURE = ["--extra-body", '{"sampling_params": {"max_new_tokens": 4, "temperature": -1}}']
TOO_LONG = ["--random-input-len", "600", "--random-range-ratio", "0.5", "--random-output-len", "4"]


def test_every_failed_request_is_counted_and_its_message_shown(deployments, tiny_model, tmp_path):
    out = tmp_path / "errors.json"
    done = serving("--base-url", deployments["colocated"].url, "--tokenizer", tiny_model, "--random-input-len", "60",
                   "--random-output-len", "4", "--num-prompts", "5", "--warmup-requests", "0", "--request-rate", "50",
                   *BAD_TEMPERATURE, "--output", str(out))
    run = json.loads(out.read_text())["runs"][0]
    assert (run["requests"], run["completed"], run["errors"]) == (5, 0, 5)
    assert run["error_kinds"] == {"HTTP 400": 5}
    assert "error: 5 x HTTP 400: invalid sampling parameters: temperature must be >= 0, got -1" in done.stdout


def test_a_failed_warm_up_stops_the_benchmark_before_any_run(deployments, tiny_model):
    done = serving("--base-url", deployments["colocated"].url, "--tokenizer", tiny_model, "--random-input-len", "60",
                   "--random-output-len", "4", "--num-prompts", "5", "--request-rate", "50", *BAD_TEMPERATURE,
                   returncode=1)
    assert "warm-up failed: 2 of 2 requests" in done.stderr
    assert "2 x HTTP 400: invalid sampling parameters: temperature must be >= 0" in done.stderr
    assert "== rate" not in done.stdout


def test_requests_longer_than_the_context_are_dropped_with_a_count(deployments, tiny_model, tmp_path):
    out = tmp_path / "drop.json"
    done = serving("--base-url", deployments["colocated"].url, "--tokenizer", tiny_model, *TOO_LONG,
                   "--num-prompts", "10", "--request-rate", "50", "--output", str(out))
    run = json.loads(out.read_text())["runs"][0]
    dropped = 10 - run["requests"]
    assert 0 < dropped < 10 and run["errors"] == 0
    assert f"dropped {dropped} of 10 requests" in done.stdout and "512-token context" in done.stdout


def test_requests_longer_than_the_context_are_clipped_to_fit_exactly(deployments, tiny_model, tmp_path):
    out = tmp_path / "clip.json"
    serving("--base-url", deployments["colocated"].url, "--tokenizer", tiny_model, *TOO_LONG, "--num-prompts", "10",
            "--request-rate", "50", "--fit-to-context", "clip", "--output", str(out), "--output-details")
    run = json.loads(out.read_text())["runs"][0]
    assert (run["requests"], run["errors"]) == (10, 0)
    details = run["details"]
    assert [d["prompt_tokens"] for d in details] == [d["input_len"] for d in details]
    assert max(d["input_len"] + d["expected_output_len"] for d in details) == 512


def test_requests_longer_than_the_context_are_refused_at_once_in_one_line(deployments, tiny_model):
    done = serving("--base-url", deployments["colocated"].url, "--tokenizer", tiny_model, *TOO_LONG,
                   "--num-prompts", "10", "--fit-to-context", "refuse", returncode=1)
    assert done.stderr.strip().startswith("refusing to start: ") and "512-token context" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "== rate" not in done.stdout


def test_a_sweep_whose_lowest_rate_misses_stops_there_and_names_the_slo(deployments, tiny_model, tmp_path):
    out = tmp_path / "sweep.json"
    done = serving("--base-url", deployments["colocated"].url, "--tokenizer", tiny_model, "--random-input-len", "60",
                   "--random-output-len", "4", "--num-prompts", "4", "--request-rate", "20", "40", "--sweep",
                   "--slo-ttft-ms", "0.001", "--output", str(out))
    result = json.loads(out.read_text())
    assert [run["request_rate"] for run in result["runs"]] == [20]
    assert result["goodput"]["goodput_req_s"] is None
    assert "no goodput: at the lowest rate, 20 req/s, 0.0% of requests met TTFT <= 0.001 ms" in done.stdout
    assert "missed: 4 over TTFT <= 0.001 ms" in done.stdout


@pytest.mark.timeout(240)
def test_a_20_s_soak_through_the_pd_router_aborts_cleanly_and_leaks_nothing(deployments, tiny_model, tmp_path):
    cluster = deployments["pd"]
    out = tmp_path / "soak.json"
    done = run_module("pdserve.bench.soak", "--base-url", cluster.router.url, "--tokenizer", tiny_model, *SMALL_MIX,
                      "--duration", "20", "--window", "5", "--request-rate", "3", "--abort-fraction", "0.3",
                      "--seed", "3", "--output", str(out), "--disable-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    total = report["total"]
    assert total["errors"] == 0 and total["aborted"] >= 5 and total["completed"] >= 20, total
    assert total["requests"] == total["completed"] + total["aborted"]
    assert report["first_window"]["completed"] > 0 and report["last_window"]["completed"] > 0
    assert [s["url"] for s in report["servers"]] == [cluster.prefill.url, cluster.decode.url]
    assert all(s["flushed"] and s["kv_pool_fully_free"] for s in report["servers"])
    roots = {p["label"]: p for p in report["processes"] if "child" not in p["label"]}
    assert set(roots) == {cluster.router.url, cluster.prefill.url, cluster.decode.url}
    assert roots[cluster.router.url]["pid"] == cluster.router.proc.pid
    assert len(report["processes"]) > 3  # the servers' scheduler and detokenizer processes too
    assert all(p["alive"] and p["rss_kb_start"] > 0 and p["fds_end"] > 0 for p in report["processes"])
    assert "PASS" in done.stdout
