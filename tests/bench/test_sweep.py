"""`python -m pdserve.bench.sweep`: the goodput of a repeat (highest passing rate, and the interpolated crossing of
the target), the spread between repeats, the summary and the `auto` table entry from synthetic runs; the command
line refused where it is wrong; and one real sweep on the CPU (two layouts of the tiny model started one after the
other by launch_cluster, two rates) that writes the JSON with every field and the PNG grid."""

from __future__ import annotations

import json
import sys
import time

import pytest

from pdserve.bench import sweep, sweep_report
from pdserve.bench.sweep_report import goodput, spread

pytestmark = pytest.mark.timeout(900)


def test_goodput_is_the_last_rate_passing_from_the_lowest_and_the_interpolated_crossing():
    assert goodput([(4, 1.0), (8, 0.5), (12, 0.95)], 0.9) == {"step": 4, "interpolated": pytest.approx(4.8),
                                                             "lower_bound_only": False}
    assert goodput([(4, 0.95), (8, 0.85)], 0.9) == {"step": 4, "interpolated": pytest.approx(6.0),
                                                    "lower_bound_only": False}
    assert goodput([(4, 1.0), (8, 0.9)], 0.9) == {"step": 8, "interpolated": 8, "lower_bound_only": True}
    assert goodput([(4, 0.5), (8, None)], 0.9) == {"step": None, "interpolated": None, "lower_bound_only": False}
    assert goodput([(4, 1.0), (8, None)], 0.9)["step"] == 4  # skipped: never measured, not a crossing
    assert goodput([], 0.9)["step"] is None  # the cluster did not start


def test_spread_is_the_range_over_the_mean_of_two_or_more_repeats():
    assert spread([9.0, 11.0]) == pytest.approx(0.2)
    assert spread([10.0]) is None and spread([10.0, None]) is None


def rate_run(rate: float, attainment: float, ttft_p90: float, errors: int = 0, free: bool = True) -> dict:
    dist = {"mean": 1.0, "p50": ttft_p90 / 2, "p90": ttft_p90, "p99": ttft_p90 * 2}
    return {"request_rate": rate, "slo_attainment": attainment, "errors": errors, "kv_pools_free": free,
            "ttft_ms": dist, "tpot_ms": {**dist, "p50": 6.0, "p99": 9.0}}


def synthetic_result() -> dict:
    runs = [{"layout": "colocated", "repeat": 0, "error": None,
             "rates": [rate_run(4, 1.0, 200), rate_run(8, 0.6, 900), {"request_rate": 12, "skipped": True}]},
            {"layout": "1p1d", "repeat": 0, "error": None,
             "rates": [rate_run(4, 1.0, 300), rate_run(8, 0.95, 700), rate_run(12, 0.7, 2000, errors=1)]},
            {"layout": "colocated", "repeat": 1, "error": None,
             "rates": [rate_run(4, 1.0, 210), rate_run(8, 0.7, 800), {"request_rate": 12, "skipped": True}]},
            {"layout": "1p1d", "repeat": 1, "error": "prefill 0 exited with code 1", "rates": []}]
    return {"layouts": ["colocated", "1p1d"], "rates": [4, 8, 12], "target_attainment": 0.9, "runs": runs,
            "duration_s": 8.0,
            "slo": {"ttft_ms": 1000.0, "tpot_ms": 10.0}, "workload": "mix", "num_gpus": 2, "repeats": 2,
            "device_name": "NVIDIA H200", "model": "/m", "date": "2026-11-28 10:00:00 UTC"}


def test_summary_counts_failures_start_errors_and_the_best_layout_among_clean_ones(tmp_path):
    result = synthetic_result()
    summary = sweep_report.summarize(result)
    colocated, pd = summary["colocated"], summary["1p1d"]
    assert colocated["goodput_req_s"] == [4, 4]
    assert colocated["goodput_interpolated_req_s"] == [pytest.approx(5.0), pytest.approx(16 / 3)]
    assert colocated["goodput_interpolated_spread"] == pytest.approx((1 / 3) / (31 / 6))
    assert colocated["per_rate"]["8"]["ttft_p90_ms"] == [900, 800] and colocated["per_rate"]["12"]["errors"] == []
    assert pd["goodput_req_s"] == [8, None] and pd["goodput_spread"] is None
    assert pd["failed_requests"] == 1 and pd["start_errors"] == ["prefill 0 exited with code 1"]
    assert sweep_report.best_layout(summary) == "colocated"  # 1p1d measured higher, but one start failed
    entry = sweep_report.auto_entry(result, summary)
    assert entry.startswith("('mix', 2): Measured('colocated', 'goodput 5.2 req/s (interpolated, mean of 2 repeats)")
    result["summary"] = summary
    table = [line.split() for line in sweep_report.rate_table_lines(result)]
    assert ["colocated", "8", "65%", "425", "/", "850", "6.0", "/", "9.0", "-", "2"] in table
    assert not any(row[:2] == ["colocated", "12"] for row in table)  # skipped in every repeat
    versus = sweep_report.versus_colocated(summary)["1p1d"]  # colocated saturates at 4 req/s
    assert versus == {"goodput_ratio": pytest.approx(8.8 / (31 / 6)), "ttft_p90_ms_ratio": {"4": 300 / 205},
                      "tpot_p99_ms_ratio": {"4": 1.0}}
    png = sweep_report.plot(result, tmp_path / "grid.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweeps_of_one_plan_merge_with_their_repeats_numbered_on_and_others_are_refused():
    first, second = synthetic_result(), synthetic_result()
    second["runs"] = second["runs"][:2]  # one repeat
    second["repeats"] = 1
    result = sweep.merged([first, second])
    assert [(r["layout"], r["repeat"]) for r in result["runs"]][-2:] == [("colocated", 2), ("1p1d", 2)]
    assert result["repeats"] == 3 and result["summary"]["colocated"]["goodput_req_s"] == [4, 4, 4]
    assert not result["passed"]  # a failed request and a failed start
    second["rates"] = [4, 8]
    with pytest.raises(SystemExit, match="sweep 2 differs from the first in rates"):
        sweep.merged([first, second])


def test_the_time_limit_lets_a_run_start_only_while_the_longest_so_far_still_fits():
    clock = sweep.Clock(limit_s=100.0)
    assert clock.fits("layout") and clock.fits("rate")  # nothing measured yet
    clock.took("rate", time.monotonic() - 80.0)
    assert not clock.fits("rate") and clock.fits("layout")
    assert sweep.Clock(limit_s=None, longest={"layout": 1e9, "rate": 1e9}).fits("layout")


@pytest.mark.parametrize("flags, message", [
    (["--layouts", "1p1d,2x2"], "unknown layout '2x2'"),
    (["--layouts", ","], "name at least one layout"),
    (["--rates", "4,0"], "positive finite"),
    (["--gpus", "0,a"], "--gpus takes comma-separated GPU ids"),
    (["--repeats", "0"], "must be positive"),
])
def test_a_bad_command_line_is_refused_before_anything_starts(tiny_model, tmp_path, capsys, flags, message):
    argv = ["--model-path", tiny_model, "--layouts", "colocated", "--rates", "4", "--out", str(tmp_path), *flags]
    with pytest.raises(SystemExit):
        sweep.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_sweep_on_the_cpu_writes_every_figure_and_the_grid(tiny_model, tmp_path, monkeypatch):
    """Two layouts, two rates, a few seconds each: every request succeeds, both pools are free after each rate."""
    out = tmp_path / "sweep"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(sys, "argv", ["sweep"])
    code = sweep.main(["--model-path", tiny_model, "--device", "cpu", "--num-gpus", "2", "--layouts",
                       "colocated,1p1d-balanced", "--rates", "2,4", "--duration", "2", "--repeats", "1",
                       "--slo-ttft-ms", "5000", "--slo-tpot-ms", "500", "--transfer-backend", "tcp",
                       "--warmup-requests", "2", "--bench-args", "--mix-input-scale 0.03 --mix-output-scale 0.05",
                       "--out", str(out), "--", "--max-total-tokens", "4096", "--context-length", "512"])
    result = json.loads((out / "sweep.json").read_text())
    assert code == 0 and result["passed"], result["summary"]
    assert [(r["layout"], r["repeat"]) for r in result["runs"]] == [("colocated", 0), ("1p1d-balanced", 0)]
    for run in result["runs"]:
        assert run["error"] is None and len(run["servers"]) == 2
        assert [r["request_rate"] for r in run["rates"]] == [2, 4]
        for rate in run["rates"]:
            assert rate["errors"] == 0 and rate["kv_pools_free"] and rate["requests"] >= 8
            assert len(rate["requests_measured"]) == rate["requests"]
            assert all(r[rate["request_fields"].index("ttft_ms")] > 0 for r in rate["requests_measured"])
    pd_counts = [r["router_counts"] for r in result["runs"][1]["rates"]]
    assert [sum(v for k, v in counts.items() if k.startswith("pdserve_router_prefill_total")) for counts in pd_counts] \
        == [r["requests"] for r in result["runs"][1]["rates"]]  # every PD request prefilled on one path or the other
    for name in ("colocated", "1p1d-balanced"):
        summary = result["summary"][name]
        assert set(summary) >= {"goodput_req_s", "goodput_interpolated_req_s", "goodput_spread", "per_rate",
                                "failed_requests", "kv_pools_free"}
        assert summary["per_rate"].keys() == {"2", "4"}
    assert result["best_layout"] in ("colocated", "1p1d-balanced") and result["auto_entry"].startswith("('mix', 2)")
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "logs" / "r0-1-1p1d-balanced" / "decode-0.log").exists()
