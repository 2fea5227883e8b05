"""Soak: steady mixed traffic with client aborts through the router, then a leak check.

    python -m pdserve.bench.soak --base-url http://127.0.0.1:8000 --tokenizer MODEL_DIR --duration 600 \\
        --request-rate 1.5 --dataset mix --mix-input-scale 0.1 --mix-output-scale 0.25 --output soak.json

Requests arrive open-loop (the serving benchmark's load generator and datasets) for --duration seconds;
--abort-fraction of them disconnect mid-stream. Reported: errors (aborts are not errors), latency percentiles of
the first and the last --window seconds, and RSS and open file descriptors of every process at start and end:
--pids, else --process-match (command-line substring), else the processes listening on the router's and its
workers' ports (`/workers`) and their children. After the run every server's prefix cache is flushed and its
KV pool must be fully free. Exit status 1 on any error or a pool that stays in use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from random import Random
from urllib.parse import urlsplit

import aiohttp

from pdserve.bench import procfs
from pdserve.bench.cli import bench_parser
from pdserve.bench.client import RequestResult
from pdserve.bench.datasets import BenchRequest
from pdserve.bench.loadgen import LoadRun, schedule
from pdserve.bench.serving import Workload, add_workload_args, client_config, context_length, model_info, prompt_builder
from pdserve.bench.stats import Slo, error_lines, summarize

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}
WINDOW_KEYS = ("requests", "completed", "errors", "aborted", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
ADMIN_TIMEOUT_S = 30.0


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__)
    add_workload_args(parser)
    parser.set_defaults(dataset="mix")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    parser.add_argument("--request-rate", type=float, default=1.5, help="requests per second")
    parser.add_argument("--abort-fraction", type=float, default=0.1, help="share of requests that disconnect")
    parser.add_argument("--window", type=float, default=60.0, help="seconds of the first and last windows")
    parser.add_argument("--pids", type=int, nargs="+", help="processes to watch (default: found from the router)")
    parser.add_argument("--process-match", help="watch the processes whose command line contains this "
                                                "(default: found from the router)")
    parser.add_argument("--kv-free-timeout", type=float, default=60.0,
                        help="seconds each server's KV pool has to be fully free after the run")
    parser.add_argument("--output", type=Path, help="JSON report")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0.0 <= args.abort_fraction <= 1.0:
        parser.error("--abort-fraction must be in [0, 1]")
    if math.isinf(args.request_rate) or args.request_rate <= 0:
        parser.error("--request-rate must be a positive finite rate")
    return args


def soak_requests(args: argparse.Namespace, info: dict) -> tuple[list[BenchRequest], list[float]]:
    """The workload of the whole run, fitted to the server's context: requests whose send time falls inside
    --duration."""
    count = math.ceil(args.request_rate * args.duration * 1.5) + 10
    requests = Workload(args, prompt_builder(args, info), context_length(info)).first(count, words_seed=args.seed)
    offsets = schedule(requests, args.request_rate, args.arrival, args.seed)
    kept = [i for i, offset in enumerate(offsets) if offset < args.duration]
    return [requests[i] for i in kept], [offsets[i] for i in kept]


def abort_policy(fraction: float, seed: int):
    """Deterministic per request: whether it disconnects, and after how many tokens (1 .. half its output)."""
    def after(index: int, request: BenchRequest) -> int | None:
        rng = Random(seed * 1_000_003 + index)
        if rng.random() >= fraction:
            return None
        return rng.randint(1, max(1, request.output_len // 2))

    return after


def window(results: list[RequestResult], start: float, end: float) -> dict:
    """Statistics of the requests sent in [start, end)."""
    inside = [r for r in results if start <= r.start_s < end]
    summary = summarize(inside, max(end - start, 1e-9), Slo())
    return {"from_s": start, "to_s": end, **{key: summary[key] for key in WINDOW_KEYS}}


# --- the deployment's processes and servers ----------------------------------------------------------------


async def get_json(session: aiohttp.ClientSession, url: str) -> tuple[int, dict | None]:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=ADMIN_TIMEOUT_S)) as response:
            body = await response.json(content_type=None) if response.status == 200 else None
            return response.status, body
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return 0, None


async def server_urls(base_url: str) -> list[str]:
    """The router's workers (`/workers`), or the base URL itself when it is a server."""
    async with aiohttp.ClientSession() as session:
        status, body = await get_json(session, base_url + "/workers")
    if status == 200 and isinstance(body, dict):
        return [w["url"] for w in body.get("workers", [])]
    return [base_url]


def watched_processes(args: argparse.Namespace, urls: list[str]) -> dict[int, str]:
    """pid -> what it is: --pids, --process-match, else whoever listens on the local URLs' ports, and children."""
    if args.pids:
        return {pid: "given" for pid in args.pids}
    if args.process_match:
        return {pid: f"matches {args.process_match!r}" for pid in procfs.matching(args.process_match)}
    labels: dict[int, str] = {}
    for url in dict.fromkeys([args.base_url, *urls]):
        parts = urlsplit(url)
        if parts.hostname not in LOCAL_HOSTS or (pid := procfs.listening_pid(parts.port or 80)) is None:
            continue
        for member in procfs.with_descendants([pid]):
            labels.setdefault(member, url if member == pid else f"{url} (child of {pid})")
    return labels


def sample_all(labels: dict[int, str]) -> dict[int, dict]:
    return {pid: {"label": label, **asdict(procfs.sample(pid))} for pid, label in labels.items()}


def process_report(before: dict[int, dict], after: dict[int, dict]) -> list[dict]:
    report = []
    for pid, start in before.items():
        end = after[pid]
        growth = None if start["rss_kb"] is None or end["rss_kb"] is None else end["rss_kb"] - start["rss_kb"]
        report.append({"pid": pid, "label": start["label"], "cmdline": start["cmdline"],
                       "rss_kb_start": start["rss_kb"], "rss_kb_end": end["rss_kb"], "rss_kb_growth": growth,
                       "fds_start": start["open_fds"], "fds_end": end["open_fds"], "alive": end["rss_kb"] is not None})
    return report


async def kv_pool_check(urls: list[str], timeout_s: float) -> list[dict]:
    """Flush every server's prefix cache (retried while requests drain), then wait for a fully free pool."""
    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(_pool_free(session, url, timeout_s) for url in urls)))


async def _pool_free(session: aiohttp.ClientSession, url: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    state = {"url": url, "flushed": False, "kv_pool_fully_free": False, "requests_in_flight": None}
    while time.monotonic() < deadline:
        if not state["flushed"]:
            try:
                async with session.post(url + "/flush_cache",
                                        timeout=aiohttp.ClientTimeout(total=ADMIN_TIMEOUT_S)) as response:
                    state["flushed"] = response.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
        status, info = await get_json(session, url + "/get_server_info")
        if status == 200 and isinstance(info, dict):
            state["requests_in_flight"] = info.get("requests_in_flight")
            state["kv_pool_fully_free"] = bool(info.get("scheduler", {}).get("kv_pool_fully_free"))
        if state["flushed"] and state["kv_pool_fully_free"]:
            return state
        await asyncio.sleep(0.5)
    return state


# --- the run -----------------------------------------------------------------------------------------------


def soak(args: argparse.Namespace) -> dict:
    info = model_info(args)
    config = client_config(args, info)
    requests, offsets = soak_requests(args, info)
    urls = asyncio.run(server_urls(config.base_url))
    labels = watched_processes(args, urls)
    before = sample_all(labels)
    load = LoadRun(config, requests, offsets, args.max_concurrency, abort_policy(args.abort_fraction, args.seed),
                   progress=not args.disable_progress, description="soak")
    results, duration = asyncio.run(load.run())
    pools = asyncio.run(kv_pool_check(urls, args.kv_free_timeout))
    after = sample_all(labels)
    total = summarize(results, duration, Slo())
    span = min(args.window, args.duration)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "base_url": args.base_url, "backend": args.backend,
        "dataset": args.dataset, "request_rate": args.request_rate, "arrival": args.arrival,
        "duration_s": args.duration, "abort_fraction": args.abort_fraction, "seed": args.seed,
        "total": {k: v for k, v in total.items() if k != "slo"},
        "first_window": window(results, 0.0, span),
        "last_window": window(results, args.duration - span, args.duration),
        "processes": process_report(before, after), "servers": pools,
        "passed": total["errors"] == 0 and all(p["kv_pool_fully_free"] for p in pools),
    }


def print_report(report: dict) -> None:
    total = report["total"]
    print(f"\nsoak {report['duration_s']:g} s at {report['request_rate']:g} req/s: {total['requests']} requests, "
          f"{total['completed']} completed, {total['aborted']} aborted, {total['errors']} errors")
    for line in error_lines(total):
        print(f"  error: {line}")
    for name in ("first_window", "last_window"):
        w = report[name]
        print(f"  {name.replace('_', ' ')} [{w['from_s']:.0f}, {w['to_s']:.0f}) s: {w['completed']} completed, "
              f"{w['errors']} errors, TTFT p99 {_ms(w['ttft_ms']['p99'])}, E2E p50 {_ms(w['e2e_ms']['p50'])} / "
              f"p99 {_ms(w['e2e_ms']['p99'])}")
    for proc in report["processes"]:
        print(f"  pid {proc['pid']} {proc['label']}: RSS {proc['rss_kb_start']} -> {proc['rss_kb_end']} kB, "
              f"fds {proc['fds_start']} -> {proc['fds_end']}")
    for server in report["servers"]:
        print(f"  {server['url']}: flushed {server['flushed']}, KV pool fully free {server['kv_pool_fully_free']}")
    print("PASS" if report["passed"] else "FAIL")


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    report = soak(args)
    print_report(report)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
