"""Serving benchmark: open-loop load against any deployment, with latency percentiles, SLO attainment and goodput.

    python -m pdserve.bench.serving --backend pdserve --base-url http://127.0.0.1:8000 --tokenizer MODEL_DIR \\
        --dataset mix --num-prompts 400 --request-rate 2 4 6 --slo-ttft-ms 1000 --slo-tpot-ms 8 --sweep \\
        --output pd.json --plot pd.png
    python -m pdserve.bench.serving plot pd.json colocated.json -o compare.png

Backends: pdserve and sglang (`/generate`), openai (`/v1/completions`), openai-chat (`/v1/chat/completions`).
Prompts are built from the served model's tokenizer, so input lengths are exact; `ignore_eos` makes output
lengths exact where the backend honours it. Warm-up requests (same shapes, other text) are not counted. Every run
(rate) sends the same shapes with its own words, so none finds an earlier run's prompts in a prefix cache.
With --sweep the rates are run in ascending order up to the first that misses the SLO attainment target, then
--bisect-steps more runs bisect between the last passing and the first failing rate: the last passing one is
the goodput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from random import Random

from pdserve.bench.client import BACKENDS, ClientConfig, as_record, served_model
from pdserve.bench.datasets import (BenchRequest, MixShape, PromptBuilder, mix_dataset, parse_trace, random_dataset,
                                    sessions_dataset, trace_dataset)
from pdserve.bench.loadgen import ARRIVALS, LoadRun, schedule
from pdserve.bench.stats import Slo, find_goodput, summarize

DATASETS = ("random", "mix", "sessions", "trace")


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Target, dataset and arrival flags; shared with the soak."""
    target = parser.add_argument_group("target")
    target.add_argument("--backend", choices=BACKENDS, default="pdserve")
    target.add_argument("--base-url", default="http://127.0.0.1:30000")
    target.add_argument("--model", help="model name for the OpenAI backends (default: the first of /v1/models)")
    target.add_argument("--tokenizer", help="the served model's tokenizer (default: the server's tokenizer_path)")
    target.add_argument("--api-key")
    target.add_argument("--request-timeout", type=float, default=600.0)
    target.add_argument("--disable-ignore-eos", action="store_true")
    target.add_argument("--min-tokens", action="store_true", help="also send min tokens = output length")
    target.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", choices=DATASETS, default="random")
    data.add_argument("--num-prompts", type=int, default=200)
    data.add_argument("--seed", type=int, default=1)
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=1.0, help="lengths uniform in [len*ratio, len]")
    data.add_argument("--mix-doc-fraction", type=float, default=0.3)
    data.add_argument("--mix-input-scale", type=float, default=1.0)
    data.add_argument("--mix-output-scale", type=float, default=1.0)
    data.add_argument("--sessions", type=int, default=16, help="multi-turn: number of sessions")
    data.add_argument("--turns", type=int, default=4)
    data.add_argument("--system-len", type=int, default=256)
    data.add_argument("--turn-input-len", type=int, default=128)
    data.add_argument("--turn-output-len", type=int, default=64)
    data.add_argument("--trace", type=Path, help="JSONL: timestamp, input_len, output_len[, prefix_group, prefix_len]")
    data.add_argument("--trace-time-unit", choices=("s", "ms"), default="s")
    data.add_argument("--trace-speedup", type=float, default=1.0)
    data.add_argument("--prefix-len", type=int, default=256, help="a trace prefix group's shared length")
    load = parser.add_argument_group("load")
    load.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    load.add_argument("--max-concurrency", type=int)
    load.add_argument("--disable-progress", action="store_true")


def client_config(args: argparse.Namespace) -> ClientConfig:
    model = args.model
    if model is None and args.backend.startswith("openai"):
        model = asyncio.run(_served_model(args.base_url))
    return ClientConfig(args.backend, args.base_url.rstrip("/"), model, not args.disable_ignore_eos, args.min_tokens,
                        args.api_key, args.request_timeout, args.extra_body)


async def _served_model(base_url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        return await served_model(session, base_url.rstrip("/"))


def prompt_builder(args: argparse.Namespace) -> PromptBuilder:
    path = args.tokenizer
    if path is None:
        with urllib.request.urlopen(args.base_url.rstrip("/") + "/get_model_info", timeout=30) as response:
            path = json.load(response)["tokenizer_path"]
        if not Path(path).exists():
            raise SystemExit(f"the server's tokenizer {path!r} is not a local path here: give --tokenizer")
    return PromptBuilder.from_path(path, chat=args.backend == "openai-chat")


def build_dataset(args: argparse.Namespace, builder: PromptBuilder, count: int, words_seed: int) -> list[BenchRequest]:
    """The workload's shapes come from --seed; `words_seed` picks its words (fresh words, same shapes)."""
    builder.reseed(words_seed)
    rng = Random(args.seed)
    if args.dataset == "random":
        return random_dataset(builder, rng, count, args.random_input_len, args.random_output_len,
                              args.random_range_ratio)
    if args.dataset == "mix":
        shape = MixShape(doc_fraction=args.mix_doc_fraction, input_scale=args.mix_input_scale,
                         output_scale=args.mix_output_scale)
        return mix_dataset(builder, rng, count, shape)
    if args.dataset == "sessions":
        return sessions_dataset(builder, args.sessions, args.turns, args.system_len, args.turn_input_len,
                                args.turn_output_len)
    if args.trace is None:
        raise SystemExit("--dataset trace needs --trace FILE")
    return trace_dataset(builder, parse_trace(args.trace, args.trace_time_unit), args.prefix_len,
                         args.trace_speedup)


def words_seed(args: argparse.Namespace, run_index: int) -> int:
    """Run k (the warm-up is -1) draws its own words: no run finds another's prompts in a prefix cache."""
    return args.seed * 7919 + run_index + 1


def warmup_requests(builder: PromptBuilder, requests: list[BenchRequest], count: int) -> list[BenchRequest]:
    """The shapes of the first `count` requests, with the builder's current words."""
    return [BenchRequest(builder.prompt(r.input_len), r.input_len, r.output_len) for r in requests[:count]]


async def run_at_rate(config: ClientConfig, requests: list[BenchRequest], rate: float, args: argparse.Namespace,
                      slo: Slo) -> dict:
    offsets = schedule(requests, rate, args.arrival, args.seed)
    label = "trace" if requests and requests[0].arrival_s is not None else f"{rate:g} req/s"
    load = LoadRun(config, requests, offsets, args.max_concurrency, progress=not args.disable_progress,
                   description=label)
    results, duration = await load.run()
    summary = summarize(results, duration, slo)
    run = {"request_rate": None if math.isinf(rate) else rate, "arrival": args.arrival, **summary}
    if args.output_details:
        run["details"] = [as_record(r) for r in results]
    return run


def print_run(run: dict) -> None:
    rate = "inf" if run["request_rate"] is None else f"{run['request_rate']:g}"
    print(f"\n== rate {rate} req/s: {run['completed']}/{run['requests']} ok, {run['errors']} errors "
          f"{run['error_kinds'] or ''} in {run['duration_s']:.1f} s")
    print(f"   throughput {run['request_throughput']:.2f} req/s, in {run['input_throughput']:.0f} tok/s, "
          f"out {run['output_throughput']:.0f} tok/s")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        dist = run[name]
        if dist["mean"] is not None:
            print(f"   {name[:-3].upper():5s} mean {dist['mean']:9.1f}  p50 {dist['p50']:9.1f}  "
                  f"p90 {dist['p90']:9.1f}  p99 {dist['p99']:9.1f} ms")
    if run["slo_attainment"] is not None and (run["slo"]["ttft_ms"] or run["slo"]["tpot_ms"]):
        print(f"   SLO attainment {100 * run['slo_attainment']:.1f}%, good {run['good_request_throughput']:.2f} req/s")


def benchmark(args: argparse.Namespace) -> dict:
    config = client_config(args)
    builder = prompt_builder(args)
    requests = build_dataset(args, builder, args.num_prompts, words_seed(args, -1))
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    warmup = None
    if args.warmup_requests:
        warm = warmup_requests(builder, requests, args.warmup_requests)
        results, duration = asyncio.run(LoadRun(config, warm, [0.0] * len(warm), progress=False).run())
        warmup = {key: value for key, value in summarize(results, duration, slo).items()
                  if key in ("requests", "completed", "errors", "error_examples")}
    runs: list[dict] = []

    def measure(rate: float) -> float:
        workload = build_dataset(args, builder, args.num_prompts, words_seed(args, len(runs)))
        run = asyncio.run(run_at_rate(config, workload, rate, args, slo))
        print_run(run)
        runs.append(run)
        return run["slo_attainment"] or 0.0

    goodput = None
    if args.sweep:
        goodput = find_goodput(measure, args.request_rate, args.bisect_steps, args.target_attainment).as_dict()
        print(f"\ngoodput {goodput['goodput_req_s']:g} req/s (first failing rate: {goodput['first_failing_rate']})")
    else:
        for rate in args.request_rate:
            measure(rate)
    return {"label": args.label, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "backend": args.backend,
            "base_url": args.base_url, "dataset": args.dataset, "num_prompts": len(requests), "seed": args.seed,
            "client": {k: v for k, v in asdict(config).items() if k != "api_key"},
            "warmup": warmup, "runs": runs, "goodput": goodput}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                        help="requests per second, one run each (inf: all at once)")
    parser.add_argument("--warmup-requests", type=int, default=2)
    parser.add_argument("--slo-ttft-ms", type=float)
    parser.add_argument("--slo-tpot-ms", type=float)
    parser.add_argument("--target-attainment", type=float, default=0.9)
    parser.add_argument("--sweep", action="store_true", help="search the goodput from --request-rate upwards")
    parser.add_argument("--bisect-steps", type=int, default=3)
    parser.add_argument("--output", type=Path, help="JSON results")
    parser.add_argument("--output-details", action="store_true", help="per-request records in the JSON")
    parser.add_argument("--plot", type=Path, help="PNG of latency and attainment against rate")
    parser.add_argument("--label", help="this run's name in plots (default: the JSON file's name)")
    args = parser.parse_args(argv)
    if args.sweep and args.slo_ttft_ms is None and args.slo_tpot_ms is None:
        parser.error("--sweep needs --slo-ttft-ms and/or --slo-tpot-ms")
    if args.sweep and any(math.isinf(r) for r in args.request_rate):
        parser.error("--sweep needs finite --request-rate values")
    if args.plot and args.output is None:
        parser.error("--plot needs --output (the chart is drawn from the JSON)")
    return args


def plot_main(argv: list[str]) -> None:
    from pdserve.bench.plots import plot_results

    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.serving plot",
                                     description="one chart of several result files")
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args(argv)
    print(plot_results(args.results, args.output))


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:
        plot_main(argv[1:])
        return None
    args = parse_args(argv)
    result = benchmark(args)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2))
    if args.plot:
        from pdserve.bench.plots import plot_results

        plot_results([args.output], args.plot)
    return result


if __name__ == "__main__":
    main()
