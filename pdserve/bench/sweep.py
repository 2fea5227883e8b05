"""Compare deployments on the same GPUs in one command: each layout is started with `launch_cluster`, warmed, and
measured with `pdserve.bench.serving`'s open-loop Poisson load at every rate; goodput, attainment and latency side
by side in a JSON and a PNG grid.

    python -m pdserve.bench.sweep --model-path M --gpus 0,1 --layouts colocated,1p1d,1p1d-balanced \\
        --rates 4,6,8,10,12 --workload mix --duration 40 --repeats 2 --slo-ttft-ms 1000 --slo-tpot-ms 10 \\
        --out DIR -- --context-length 16384
    python -m pdserve.bench.sweep plot DIR/sweep.json -o DIR/sweep.png
    python -m pdserve.bench.sweep merge CALL1/sweep.json CALL2/sweep.json --out DIR   # repeats from several calls

Layouts (`pdserve.layouts`): `colocated` (one server per GPU behind the regular router), `XpYd` (PD behind the PD
router), `XpYd-balanced` (PD, the decode servers prefilling within --decode-tpot-budget-ms, by default 0.85 x the
TPOT SLO). The repeats interleave the layouts (A, B, C, A, B, C), each start a fresh cluster. In a layout's run the rates
go up from the lowest; after a rate whose attainment falls below --stop-below the higher ones are skipped (counted
as failing); with --time-limit, a layout run or a rate starts only while the longest one so far still fits, so
the sweep ends with every cluster stopped (a goodput cut short is a lower bound). Every rate sends `rate x
--duration` requests of the workload (streamed, greedy, ignore_eos; the same shapes and arrival times for every
layout and repeat), then checks that every server's KV pool is fully free. Flags after `--` go to every server.
Exit status 1 when a request failed, a pool stayed in use or a cluster did not start.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from pdserve import launch_cluster
from pdserve.bench import serving, sweep_report
from pdserve.bench.cli import bench_parser, write_result
from pdserve.bench.client import ClientConfig, RequestResult
from pdserve.bench.datasets import PromptBuilder
from pdserve.bench.plots import require_matplotlib
from pdserve.bench.soak import kv_pool_check
from pdserve.bench.stats import ATTAINMENT_TARGET, Slo
from pdserve.layouts import WORKLOADS, LayoutError, check_layout_name
from pdserve.server_processes import ClusterError

WORKLOAD_FLAGS = {"mix": [], "chat": ["--mix-doc-fraction", "0"], "docs": ["--mix-doc-fraction", "1"]}
KV_FREE_TIMEOUT_S = 30.0
ROUTER_COUNTERS = ("pdserve_router_prefill_total", "pdserve_router_local_prefill_decisions_total",
                   "pdserve_router_role_switches_total")
SHUTDOWN_DRAIN_S = 5.0
BUDGET_SHARE_OF_SLO = 0.85  # the decode budget's margin under the TPOT SLO (a request's TPOT varies around the mean)
STOP_MARGIN_S = 30.0  # a cluster's stop, and the summary, after the last run the time limit lets start
EXIT_OK, EXIT_FAILED = 0, 1


# ---- command line ---------------------------------------------------------------------------------------------


def number_list(value: str) -> list[float]:
    try:
        numbers = [float(v) for v in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {value!r}") from None
    if not all(math.isfinite(n) and n > 0 for n in numbers):
        raise argparse.ArgumentTypeError(f"every rate must be a positive finite number, got {value!r}")
    return sorted(set(numbers))


def layout_list(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise argparse.ArgumentTypeError("name at least one layout")
    try:
        return [name if name == "auto" else check_layout_name(name) for name in dict.fromkeys(names)]
    except LayoutError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__)
    parser.add_argument("--model-path", required=True, help="HF-format model folder (its tokenizer builds prompts)")
    parser.add_argument("--layouts", type=layout_list, required=True,
                        help="comma-separated: colocated, 1p1d, 2p2d-balanced, ..., auto (what launch_cluster picks)")
    parser.add_argument("--rates", type=number_list, required=True, help="request rates (req/s), comma-separated")
    parser.add_argument("--workload", "--dataset", choices=WORKLOADS, default="mix",
                        help="mix: 70%% chat 512-2048 in / 128-384 out, 30%% documents 6-8k in / 64-128 out; chat "
                             "or docs: one part alone")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per rate")
    parser.add_argument("--repeats", type=int, default=2, help="runs of every layout, interleaved")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="SLO on the time to first token")
    parser.add_argument("--slo-tpot-ms", type=float, default=10.0, help="SLO on the time per output token")
    parser.add_argument("--target-attainment", type=float, default=ATTAINMENT_TARGET,
                        help="the share of requests within the SLO for a rate to pass")
    parser.add_argument("--stop-below", type=float, default=0.5,
                        help="skip a layout's higher rates after one whose attainment is below this")
    parser.add_argument("--gpus", help="GPU ids to use, e.g. 0,1 (default: every visible one)")
    parser.add_argument("--num-gpus", type=int, help="GPUs (on the CPU: servers) a layout fills (default: all)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="as launch_cluster's")
    parser.add_argument("--transfer-backend", choices=launch_cluster.BACKENDS, default="auto",
                        help="KV transfer backend of the PD layouts")
    parser.add_argument("--decode-tpot-budget-ms", type=float,
                        help="-balanced layouts' decode budget (default: 0.85 x --slo-tpot-ms)")
    parser.add_argument("--router-args", default="", help="extra router flags in one string, every layout")
    parser.add_argument("--bench-args", default="",
                        help="extra pdserve.bench.serving flags in one string, e.g. \"--mix-input-scale 0.5\"")
    parser.add_argument("--warmup-requests", type=int, default=8, help="requests sent at once to each fresh cluster")
    parser.add_argument("--min-requests", type=int, default=8, help="the fewest requests a rate sends")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for a cluster to start")
    parser.add_argument("--time-limit", type=float,
                        help="seconds the whole sweep may take: a layout run or a rate starts only if the longest "
                             "so far still fits, so every cluster is stopped in time (default: none)")
    parser.add_argument("--out", type=Path, required=True, help="folder for sweep.json, sweep.png and logs/")
    return parser


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    argv, engine_args = launch_cluster.split_engine_args(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.duration <= 0 or args.min_requests < 1:
        parser.error("--repeats, --duration and --min-requests must be positive")
    if not 0 < args.target_attainment <= 1 or not 0 <= args.stop_below <= 1:
        parser.error("--target-attainment must be in (0, 1] and --stop-below in [0, 1]")
    if args.gpus is not None:
        try:
            gpu_ids = [int(g) for g in args.gpus.split(",")]
        except ValueError:
            parser.error(f"--gpus takes comma-separated GPU ids, got {args.gpus!r}")
        args.num_gpus = args.num_gpus or len(gpu_ids)
    args.decode_tpot_budget_ms = args.decode_tpot_budget_ms or BUDGET_SHARE_OF_SLO * args.slo_tpot_ms
    try:  # a bad engine flag or model path fails here, not in every layout's start
        launch_cluster.parse_args(cluster_argv(args, args.layouts[0], args.out / "logs", engine_args))
    except launch_cluster.LaunchConfigError as exc:
        parser.error(str(exc))
    require_matplotlib()
    return args, engine_args


# ---- one layout, once -----------------------------------------------------------------------------------------


def cluster_argv(args: argparse.Namespace, layout: str, log_dir: Path, engine_args: list[str]) -> list[str]:
    """launch_cluster's command line for `layout`."""
    argv = ["--model-path", args.model_path, "--layout", layout, "--device", args.device,
            "--transfer-backend", args.transfer_backend, "--decode-tpot-budget-ms", f"{args.decode_tpot_budget_ms:g}",
            "--log-dir", str(log_dir), "--startup-timeout", f"{args.startup_timeout:g}",
            "--shutdown-drain-timeout-s", f"{SHUTDOWN_DRAIN_S:g}", "--router-args", args.router_args]
    argv += ["--num-gpus", str(args.num_gpus)] if args.num_gpus else []
    return [*argv, "--", *engine_args]


def bench_argv(args: argparse.Namespace, router_url: str) -> list[str]:
    """pdserve.bench.serving's command line against `router_url` (--bench-args last: they win)."""
    return ["--backend", "pdserve", "--base-url", router_url, "--tokenizer", args.model_path, "--dataset", "mix",
            *WORKLOAD_FLAGS[args.workload], "--slo-ttft-ms", f"{args.slo_ttft_ms:g}",
            "--slo-tpot-ms", f"{args.slo_tpot_ms:g}", "--warmup-requests", str(args.warmup_requests),
            "--request-timeout", "120", "--disable-progress", *shlex.split(args.bench_args)]


def request_record(result: RequestResult) -> list:
    """One request in the JSON: [start s, input tokens, output tokens, TTFT ms, TPOT ms, error]."""
    tpot = result.tpot
    return [round(result.start_s, 4), result.input_len, result.output_len,
            round(1000 * result.ttft, 2) if result.success else None,
            round(1000 * tpot, 3) if result.success and tpot is not None else None, result.error or None]


REQUEST_FIELDS = ["start_s", "input_len", "output_len", "ttft_ms", "tpot_ms", "error"]


@dataclass(slots=True)
class LayoutBench:
    """pdserve.bench.serving's pieces against one started cluster; the prompt builder is shared by every layout."""

    args: argparse.Namespace
    bench: argparse.Namespace
    workload: serving.Workload
    config: ClientConfig
    slo: Slo

    @classmethod
    def connect(cls, args: argparse.Namespace, router_url: str, builders: dict[str, PromptBuilder]) -> "LayoutBench":
        bench = serving.parse_args(bench_argv(args, router_url))
        info = serving.model_info(bench)
        if bench.tokenizer not in builders:
            builders[bench.tokenizer] = serving.prompt_builder(bench, info)
        workload = serving.Workload(bench, builders[bench.tokenizer], serving.context_length(info))
        return cls(args, bench, workload, serving.client_config(bench, info),
                   Slo(bench.slo_ttft_ms, bench.slo_tpot_ms))

    def warm(self) -> dict:
        requests = self.workload.first(max(self.bench.warmup_requests, 1), serving.words_seed(self.bench, -1))
        return serving.warm_up(self.config, serving.warmup_requests(self.workload.builder, requests,
                                                                    self.bench.warmup_requests), self.slo)

    def measure(self, rate: float, run_index: int) -> tuple[dict, list[RequestResult]]:
        count = max(self.args.min_requests, round(rate * self.args.duration))
        requests, _ = self.workload.build(count, serving.words_seed(self.bench, run_index))
        return asyncio.run(serving.run_at_rate(self.config, requests, rate, self.bench, self.slo))


def router_counters(router_url: str) -> dict[str, float]:
    """The router's prefill-path counters (`pdserve_router_prefill_total{path=...}`, with --local-prefill-by-load
    its decisions by reason, with --balance-roles its role switches), by sample name and labels; empty if /metrics
    does not answer."""
    try:
        with urllib.request.urlopen(router_url + "/metrics", timeout=10) as response:
            text = response.read().decode(errors="replace")
    except (OSError, urllib.error.URLError):
        return {}
    counters = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith(ROUTER_COUNTERS):
            try:
                counters[name] = float(value)
            except ValueError:
                continue
    return counters


def measured_rate(bench: LayoutBench, rate: float, run_index: int, urls: list[str]) -> dict:
    """One rate against the cluster (`urls`: its servers, then its router): the run's figures, every request's
    record, the router's prefill-path counts during it, and whether every server's KV pool is free after it."""
    before = router_counters(urls[-1])
    summary, results = bench.measure(rate, run_index)
    after = router_counters(urls[-1])
    pools = asyncio.run(kv_pool_check(urls[:-1], KV_FREE_TIMEOUT_S))
    keep = ("request_rate", "requests", "completed", "errors", "error_kinds", "first_errors", "duration_s",
            "request_throughput", "output_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "slo_attainment",
            "slo_misses", "good_request_throughput")
    return {**{k: summary[k] for k in keep}, "kv_pools_free": all(p["kv_pool_fully_free"] for p in pools),
            "kv_pools": pools, "router_counts": {k: v - before.get(k, 0.0) for k, v in after.items()},
            "request_fields": REQUEST_FIELDS, "requests_measured": [request_record(r) for r in results]}


@dataclass(slots=True)
class Clock:
    """The sweep's time limit: a layout run or a rate starts only if the longest one so far still fits."""

    limit_s: float | None
    started: float = field(default_factory=time.monotonic)
    longest: dict[str, float] = field(default_factory=lambda: {"layout": 0.0, "rate": 0.0})

    def fits(self, kind: str) -> bool:
        if self.limit_s is None:
            return True
        return time.monotonic() - self.started + self.longest[kind] + STOP_MARGIN_S <= self.limit_s

    def took(self, kind: str, since: float) -> None:
        self.longest[kind] = max(self.longest[kind], time.monotonic() - since)


@dataclass(slots=True)
class Sweeper:
    args: argparse.Namespace
    engine_args: list[str]
    bar: tqdm
    clock: Clock
    builders: dict[str, PromptBuilder] = field(default_factory=dict)  # one prompt builder for every layout

    def run_layout(self, layout: str, repeat: int, order: int) -> dict:
        """Start `layout`, warm it, measure its rates (`measure_rates`), stop it."""
        record = {"layout": layout, "repeat": repeat, "error": None, "rates": []}
        log_dir = self.args.out / "logs" / f"r{repeat}-{order}-{layout}"
        ns, engine_args = launch_cluster.parse_args(cluster_argv(self.args, layout, log_dir, self.engine_args))
        log_dir.mkdir(parents=True, exist_ok=True)
        cluster = launch_cluster.Cluster(str(log_dir), SHUTDOWN_DRAIN_S, ns.cluster_secret)
        since = time.monotonic()
        try:
            started = launch_cluster.start_cluster(ns, engine_args, cluster)
            record["servers"], record["layout_line"] = started.server_urls, started.layout_line
            bench = LayoutBench.connect(self.args, started.router_url, self.builders)
            record["warmup"] = bench.warm()
            self.measure_rates(bench, [*started.server_urls, started.router_url], record)
        except (ClusterError, SystemExit) as exc:
            record["error"] = str(exc)
            print(f"sweep: {layout} (repeat {repeat + 1}) stopped: {exc}", file=sys.stderr, flush=True)
        finally:
            cluster.stop()
        self.clock.took("layout", since)
        return record

    def measure_rates(self, bench: LayoutBench, urls: list[str], record: dict) -> None:
        """The rates upwards; those above a rate under --stop-below are skipped (they count as failing), those
        the time limit leaves no room for are left out (the goodput is then a lower bound)."""
        stop = False
        for index, rate in enumerate(self.args.rates):
            self.bar.set_description(f"repeat {record['repeat'] + 1} {record['layout']} {rate:g} req/s")
            if not stop and not self.clock.fits("rate"):
                record["cut_by_time_limit"] = True
                return
            if stop:
                record["rates"].append({"request_rate": rate, "skipped": True})
            else:
                since = time.monotonic()
                run = measured_rate(bench, rate, record["repeat"] * len(self.args.rates) + index, urls)
                self.clock.took("rate", since)
                record["rates"].append(run)
                stop = (run["slo_attainment"] or 0.0) < self.args.stop_below
            self.bar.update(1)


# ---- the sweep ------------------------------------------------------------------------------------------------


def device_name(args: argparse.Namespace) -> str:
    """The first GPU's name from nvidia-smi (this process keeps off the GPUs the servers get); "CPU" without."""
    if args.device == "cpu" or not launch_cluster.visible_gpus():
        return "CPU"
    first = (args.gpus or os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", first],
                               capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return "GPU"
    return query.stdout.strip() or "GPU"


def gpu_count(args: argparse.Namespace) -> int:
    """The GPUs (on the CPU: servers) each layout fills, as launch_cluster counts them."""
    visible = 0 if args.device == "cpu" else launch_cluster.visible_gpus()
    return args.num_gpus or visible or launch_cluster.CPU_SLOTS


def sweep(args: argparse.Namespace, engine_args: list[str]) -> dict:
    if args.gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = args.gpus  # before torch counts the GPUs (launch_cluster.visible_gpus)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "model": args.model_path, "workload": args.workload,
              "device_name": device_name(args), "num_gpus": gpu_count(args),
              "gpus": args.gpus, "layouts": args.layouts, "rates": args.rates, "duration_s": args.duration,
              "repeats": args.repeats, "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
              "target_attainment": args.target_attainment, "decode_tpot_budget_ms": args.decode_tpot_budget_ms,
              "transfer_backend": args.transfer_backend, "engine_args": engine_args, "bench_args": args.bench_args,
              "command": " ".join(shlex.quote(a) for a in sys.argv), "time_limit_reached": False, "runs": []}
    print(f"sweep: {len(args.layouts)} layouts x {args.repeats} repeats = {len(args.layouts) * args.repeats} cluster "
          f"starts, up to {len(args.rates)} rates of {args.duration:g} s of arrivals each", flush=True)
    with tqdm(total=args.repeats * len(args.layouts) * len(args.rates), unit="rate") as bar:
        sweeper = Sweeper(args, engine_args, bar, Clock(args.time_limit))
        for repeat, (order, layout) in itertools.product(range(args.repeats), enumerate(args.layouts)):
            if not sweeper.clock.fits("layout"):
                result["time_limit_reached"] = True
                print(f"sweep: the time limit leaves no room for another layout run; stopping before {layout} "
                      f"(repeat {repeat + 1})", file=sys.stderr, flush=True)
                break
            result["runs"].append(sweeper.run_layout(layout, repeat, order))
            write_result(args.out / "sweep.json", result)  # what ran so far survives an interrupted sweep
    return summarized(result)


def summarized(result: dict) -> dict:
    """`result` with each layout's summary, the best layout, its `auto` entry and whether every run was clean."""
    summary = sweep_report.summarize(result)
    passed = all(s["failed_requests"] == 0 and s["kv_pools_free"] and not s["start_errors"] for s in summary.values())
    return {**result, "summary": summary, "versus_colocated": sweep_report.versus_colocated(summary),
            "best_layout": sweep_report.best_layout(summary),
            "auto_entry": sweep_report.auto_entry(result, summary), "passed": passed}


MERGE_KEYS = ("layouts", "rates", "slo", "workload", "num_gpus", "target_attainment", "duration_s")


def merged(results: list[dict]) -> dict:
    """Sweeps of one plan (e.g. one repeat per device call) as one, their repeats numbered on."""
    first, runs, repeats = results[0], [], 0
    for index, result in enumerate(results):
        differ = [key for key in MERGE_KEYS if result[key] != first[key]]
        if differ:
            raise SystemExit(f"sweep {index + 1} differs from the first in {', '.join(differ)}: only sweeps of the "
                             "same layouts, rates, SLO, workload, GPUs and duration merge")
        runs += [{**run, "repeat": run["repeat"] + repeats} for run in result["runs"]]
        repeats += result["repeats"]
    return summarized({**first, "runs": runs, "repeats": repeats, "merged_dates": [r["date"] for r in results]})


def report(result: dict) -> None:
    print("\n" + "\n".join(sweep_report.rate_table_lines(result) + [""] + sweep_report.summary_lines(result)
                            + sweep_report.versus_lines(result["versus_colocated"])))
    if result["auto_entry"]:
        print(f"best: {result['best_layout']}; its pdserve/layouts.py MEASURED_BEST entry:\n    {result['auto_entry']}")
    print("PASS: no request failed, every KV pool free after every run" if result["passed"] else
          "FAIL: a request failed, a KV pool stayed in use, or a cluster did not start (see sweep.json)")


def save(result: dict, out: Path) -> None:
    write_result(out / "sweep.json", result)
    sweep_report.plot(result, out / "sweep.png")
    report(result)
    print(f"results: {out / 'sweep.json'}, {out / 'sweep.png'}")


def run(argv: list[str]) -> dict:
    args, engine_args = parse_args(argv)
    result = sweep(args, engine_args)
    save(result, args.out)
    return result


def plot_main(argv: list[str]) -> dict:
    parser = bench_parser("the PNG grid of a saved sweep (one cut short too)",
                          prog="python -m pdserve.bench.sweep plot")
    parser.add_argument("result", type=Path, help="a sweep.json")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    result = summarized(json.loads(args.result.read_text()))  # a sweep cut short has no summary yet
    print(sweep_report.plot(result, args.output))
    return result


def merge_main(argv: list[str]) -> dict:
    parser = bench_parser("one sweep of several sweep.json files of the same plan (their repeats in order)",
                          prog="python -m pdserve.bench.sweep merge")
    parser.add_argument("results", type=Path, nargs="+", help="sweep.json files")
    parser.add_argument("--out", type=Path, required=True, help="folder for the merged sweep.json and sweep.png")
    args = parser.parse_args(argv)
    result = merged([json.loads(path.read_text()) for path in args.results])
    save(result, args.out)
    return result


SUBCOMMANDS = {"plot": plot_main, "merge": merge_main}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = SUBCOMMANDS.get(argv[0]) if argv else None
    result = command(argv[1:]) if command else run(argv)
    return EXIT_OK if result["passed"] else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
