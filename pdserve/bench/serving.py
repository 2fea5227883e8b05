"""Serving benchmark: open-loop load against any deployment, with latency percentiles, SLO attainment and goodput.

    python -m pdserve.bench.serving --backend pdserve --base-url http://127.0.0.1:8000 --tokenizer MODEL_DIR \\
        --dataset mix --num-prompts 400 --request-rate 2 4 6 --slo-ttft-ms 1000 --slo-tpot-ms 8 --sweep \\
        --output pd.json --plot pd.png
    python -m pdserve.bench.serving plot pd.json colocated.json -o compare.png

Backends: pdserve and sglang (`/generate`), openai (`/v1/completions`), openai-chat (`/v1/chat/completions`).
Prompts are built from the served model's tokenizer, so input lengths are exact; `ignore_eos` makes output
lengths exact where the backend honours it. Requests that do not fit the server's context length (its
/get_model_info max_context_len, else /v1/models' max_model_len) are dropped, clipped or refused before anything
is sent (--fit-to-context). Warm-up requests (same shapes, other text) are not counted; if one fails, the
benchmark stops with its error. Every run (rate) sends the same shapes with its own words, so none finds an
earlier run's prompts in a prefix cache. With --sweep the goodput is searched upwards: the rates in ascending
order, then doublings of the highest up to --max-request-rate, until one misses the SLO attainment target; then
--bisect-steps more runs bisect between the last passing and the first failing rate: the last passing one is
the goodput. If the lowest rate already misses, the sweep stops and says why (failures, TTFT or TPOT).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path
from random import Random

from pdserve.bench.cli import bench_parser, run_with_plot, write_result
from pdserve.bench.client import BACKENDS, ClientConfig, RequestResult, as_record
from pdserve.bench.datasets import (FIT_POLICIES, BenchRequest, MixShape, PromptBuilder, fit_to_context, mix_dataset,
                                    parse_trace, random_dataset, sessions_dataset, trace_dataset)
from pdserve.bench.loadgen import ARRIVALS, LoadRun, schedule
from pdserve.bench.plots import plot_results, require_matplotlib
from pdserve.bench.stats import DEFAULT_MAX_RATE, Slo, error_lines, find_goodput, summarize

DATASETS = ("random", "mix", "sessions", "trace")


def add_target_args(parser: argparse.ArgumentParser) -> None:
    """Where the requests go and how they are sent; shared with the soak and the constrained benchmark."""
    target = parser.add_argument_group("target")
    target.add_argument("--backend", choices=BACKENDS, default="pdserve", help="the API the requests use")
    target.add_argument("--base-url", default="http://127.0.0.1:30000", help="a router's or a server's URL")
    target.add_argument("--model", help="model name for the OpenAI backends (default: the first of /v1/models)")
    target.add_argument("--tokenizer", help="the served model's tokenizer (default: the server's tokenizer_path)")
    target.add_argument("--api-key", help="sent as a bearer token")
    target.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request fails")
    target.add_argument("--disable-ignore-eos", action="store_true",
                        help="let requests stop at EOS (output lengths are no longer exact)")
    target.add_argument("--min-tokens", action="store_true", help="also send min tokens = output length")
    target.add_argument("--extra-body", type=json.loads, default={},
                        help="JSON merged into every request body (its sampling_params into the request's own)")


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Target, dataset and arrival flags; shared with the soak."""
    add_target_args(parser)
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", choices=DATASETS, default="random", help="the workload's shapes")
    data.add_argument("--num-prompts", type=int, default=200, help="requests per run")
    data.add_argument("--seed", type=int, default=1, help="seeds the shapes and the arrival times")
    data.add_argument("--words-offset", type=int, default=0,
                      help="draws other words for the same shapes (another invocation with the same --seed finds "
                           "none of this one's prompts in a prefix cache)")
    data.add_argument("--fit-to-context", choices=FIT_POLICIES, default="drop",
                      help="requests whose prompt + output exceed the server's context length: drop them (as "
                           "SGLang's --sharegpt-context-len), clip their prompts, or refuse to start; the count is "
                           "printed")
    data.add_argument("--random-input-len", type=int, default=1024, help="random: the longest prompt")
    data.add_argument("--random-output-len", type=int, default=128, help="random: the longest output")
    data.add_argument("--random-range-ratio", type=float, default=1.0, help="lengths uniform in [len*ratio, len]")
    data.add_argument("--mix-doc-fraction", type=float, default=0.3, help="mix: the share of long documents")
    data.add_argument("--mix-input-scale", type=float, default=1.0, help="mix: scales every prompt length")
    data.add_argument("--mix-output-scale", type=float, default=1.0, help="mix: scales every output length")
    data.add_argument("--sessions", type=int, default=16, help="multi-turn: number of sessions")
    data.add_argument("--turns", type=int, default=4, help="multi-turn: turns per session")
    data.add_argument("--system-len", type=int, default=256, help="multi-turn: tokens of the system prompt")
    data.add_argument("--turn-input-len", type=int, default=128, help="multi-turn: new user tokens per turn")
    data.add_argument("--turn-output-len", type=int, default=64, help="multi-turn: output tokens per turn")
    data.add_argument("--trace", type=Path, help="JSONL: timestamp, input_len, output_len[, prefix_group, prefix_len]")
    data.add_argument("--trace-time-unit", choices=("s", "ms"), default="s", help="the trace's timestamp unit")
    data.add_argument("--trace-speedup", type=float, default=1.0, help="divides the trace's send times")
    data.add_argument("--prefix-len", type=int, default=256, help="a trace prefix group's shared length")
    load = parser.add_argument_group("load")
    load.add_argument("--arrival", choices=ARRIVALS, default="poisson", help="the arrival process of a rate")
    load.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: unbounded)")
    load.add_argument("--disable-progress", action="store_true", help="no progress bar")


def client_config(args: argparse.Namespace, info: dict) -> ClientConfig:
    model = args.model or info.get("id")
    if model is None and args.backend.startswith("openai"):
        raise SystemExit(f"the server at {args.base_url} lists no model at /v1/models: give --model")
    return ClientConfig(args.backend, args.base_url.rstrip("/"), model, not args.disable_ignore_eos, args.min_tokens,
                        args.api_key, args.request_timeout, args.extra_body)


def server_json(args: argparse.Namespace, path: str) -> dict | None:
    """The server's JSON answer at `path`; None when it has no such route or answers no JSON object."""
    url = args.base_url.rstrip("/") + path
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
            body = json.load(response)
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError) as exc:
        raise SystemExit(f"cannot reach the server at {args.base_url}: {getattr(exc, 'reason', exc)}") from exc
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def model_info(args: argparse.Namespace) -> dict:
    """/get_model_info (pdserve, SGLang) merged over the first card of /v1/models (OpenAI-compatible servers):
    the tokenizer, the model's name and the context length, as far as the server tells them."""
    models = server_json(args, "/v1/models") or {}
    card = (models.get("data") or [{}])[0]
    return {**card, **(server_json(args, "/get_model_info") or {})}


def context_length(info: dict) -> int | None:
    """pdserve's and SGLang's max_context_len, else vLLM's and pdserve's max_model_len of /v1/models."""
    value = info.get("max_context_len") or info.get("max_model_len")
    return int(value) if value else None


def prompt_builder(args: argparse.Namespace, info: dict) -> PromptBuilder:
    path = args.tokenizer or info.get("tokenizer_path")
    if path is None:
        raise SystemExit(f"the server at {args.base_url} does not name its tokenizer: give --tokenizer")
    if args.tokenizer is None and not Path(path).exists():
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


class Workload:
    """The dataset fitted to the server's context: every run builds the same shapes with words of its own."""

    def __init__(self, args: argparse.Namespace, builder: PromptBuilder, context_len: int | None):
        self.args = args
        self.builder = builder
        self.context_len = context_len

    def build(self, count: int, words_seed: int) -> tuple[list[BenchRequest], int]:
        """The fitted requests and how many of the dataset's did not fit."""
        requests = build_dataset(self.args, self.builder, count, words_seed)
        if self.context_len is None:
            return requests, 0
        try:
            return fit_to_context(requests, self.context_len, self.args.fit_to_context)
        except ValueError as exc:
            raise SystemExit(f"refusing to start: {exc}; shrink the dataset or pass --fit-to-context drop|clip") \
                from exc

    def first(self, count: int, words_seed: int) -> list[BenchRequest]:
        """`build`, saying what the fitting changed (the later builds change the same requests)."""
        if self.context_len is None:
            print("the server does not report its context length: the requests are sent as built")
        requests, unfit = self.build(count, words_seed)
        if unfit and self.args.fit_to_context == "drop":
            print(f"dropped {unfit} of {unfit + len(requests)} requests: their prompt + output exceed the server's "
                  f"{self.context_len}-token context (--fit-to-context drop)")
        elif unfit:
            print(f"shortened the prompts of {unfit} of {len(requests)} requests to fit the server's "
                  f"{self.context_len}-token context (--fit-to-context clip)")
        if not requests:
            raise SystemExit(f"no request fits the server's {self.context_len}-token context")
        return requests


def words_seed(args: argparse.Namespace, run_index: int) -> int:
    """Run k (the warm-up is -1) draws its own words: no run finds another's prompts in a prefix cache."""
    return args.seed * 7919 + args.words_offset * 104729 + run_index + 1


def warmup_requests(builder: PromptBuilder, requests: list[BenchRequest], count: int) -> list[BenchRequest]:
    """The shapes of the first `count` requests, with the builder's current words."""
    return [BenchRequest(builder.prompt(r.input_len), r.input_len, r.output_len) for r in requests[:count]]


def warm_up(config: ClientConfig, warm: list[BenchRequest], slo: Slo) -> dict:
    """Send the warm-up requests all at once; any failure ends the benchmark, naming the errors."""
    results, duration = asyncio.run(LoadRun(config, warm, [0.0] * len(warm), progress=False).run())
    summary = summarize(results, duration, slo)
    if summary["errors"]:
        raise SystemExit(f"warm-up failed: {summary['errors']} of {summary['requests']} requests\n  "
                         + "\n  ".join(error_lines(summary)))
    return {key: summary[key] for key in ("requests", "completed", "errors")}


async def run_at_rate(config: ClientConfig, requests: list[BenchRequest], rate: float, args: argparse.Namespace,
                      slo: Slo) -> tuple[dict, list[RequestResult]]:
    """The run's summary (with every request's record under --output-details) and the results themselves."""
    offsets = schedule(requests, rate, args.arrival, args.seed)
    label = "trace" if requests and requests[0].arrival_s is not None else f"{rate:g} req/s"
    load = LoadRun(config, requests, offsets, args.max_concurrency, progress=not args.disable_progress,
                   description=label)
    results, duration = await load.run()
    summary = summarize(results, duration, slo)
    run = {"request_rate": None if math.isinf(rate) else rate, "arrival": args.arrival, **summary}
    if args.output_details:
        run["details"] = [as_record(r) for r in results]
    return run, results


def slo_misses(run: dict, slo: Slo) -> str:
    """Why requests missed the SLO: "6 failed, 14 over TTFT <= 1000 ms"."""
    limits = slo.limits()
    return ", ".join(f"{count} failed" if term == "failed" else f"{count} over {limits[term]}"
                     for term, count in run["slo_misses"].items())


def print_run(run: dict, slo: Slo) -> None:
    rate = "inf" if run["request_rate"] is None else f"{run['request_rate']:g}"
    print(f"\n== rate {rate} req/s: {run['completed']}/{run['requests']} ok, {run['errors']} errors "
          f"in {run['duration_s']:.1f} s")
    for line in error_lines(run):
        print(f"   error: {line}")
    print(f"   throughput {run['request_throughput']:.2f} req/s, in {run['input_throughput']:.0f} tok/s, "
          f"out {run['output_throughput']:.0f} tok/s")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        dist = run[name]
        if dist["mean"] is not None:
            print(f"   {name[:-3].upper():5s} mean {dist['mean']:9.1f}  p50 {dist['p50']:9.1f}  "
                  f"p90 {dist['p90']:9.1f}  p99 {dist['p99']:9.1f} ms")
    if run["slo_attainment"] is not None and (slo.ttft_ms or slo.tpot_ms):
        misses = f" (missed: {slo_misses(run, slo)})" if run["slo_misses"] else ""
        print(f"   SLO attainment {100 * run['slo_attainment']:.1f}%{misses}, "
              f"good {run['good_request_throughput']:.2f} req/s")


def goodput_line(goodput: dict, runs: list[dict], slo: Slo) -> str:
    """The sweep's answer in words; without a passing rate, why the lowest rate missed."""
    target = f"{100 * goodput['target_attainment']:g}%"
    if goodput["goodput_req_s"] is None:
        lowest = runs[0]
        return (f"no goodput: at the lowest rate, {lowest['request_rate']:g} req/s, "
                f"{100 * (lowest['slo_attainment'] or 0):.1f}% of requests met {slo.describe()} (target {target}; "
                f"missed: {slo_misses(lowest, slo)}); try lower --request-rate values")
    if goodput["lower_bound_only"]:
        return (f"goodput >= {goodput['goodput_req_s']:g} req/s: every rate up to it met {slo.describe()} "
                f"for {target} of requests (raise --max-request-rate to search further)")
    return (f"goodput {goodput['goodput_req_s']:g} req/s at {slo.describe()} for {target} of requests "
            f"({goodput['first_failing_rate']:g} req/s missed)")


def benchmark(args: argparse.Namespace) -> dict:
    info = model_info(args)
    config = client_config(args, info)
    builder = prompt_builder(args, info)
    workload = Workload(args, builder, context_length(info))
    requests = workload.first(args.num_prompts, words_seed(args, -1))
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    warmup = warm_up(config, warmup_requests(builder, requests, args.warmup_requests), slo) \
        if args.warmup_requests else None
    runs: list[dict] = []

    def measure(rate: float) -> float:
        run_requests, _ = workload.build(args.num_prompts, words_seed(args, len(runs)))
        run, _ = asyncio.run(run_at_rate(config, run_requests, rate, args, slo))
        print_run(run, slo)
        runs.append(run)
        return run["slo_attainment"] or 0.0

    goodput = None
    if args.sweep:
        goodput = find_goodput(measure, args.request_rate, args.bisect_steps, args.target_attainment,
                               args.max_request_rate).as_dict()
        print("\n" + goodput_line(goodput, runs, slo))
    else:
        for rate in args.request_rate:
            measure(rate)
    return {"label": args.label, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "backend": args.backend,
            "model": config.model or info.get("model_path") or info.get("id"), "base_url": args.base_url,
            "context_length": workload.context_len, "fit_to_context": args.fit_to_context, "dataset": args.dataset,
            "num_prompts": len(requests), "seed": args.seed,
            "client": {k: v for k, v in asdict(config).items() if k != "api_key"},
            "warmup": warmup, "runs": runs, "goodput": goodput}


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__)
    add_workload_args(parser)
    parser.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                        help="requests per second, one run each (inf: all at once); with --sweep, where it starts")
    parser.add_argument("--warmup-requests", type=int, default=2,
                        help="requests sent first and not counted; any failure among them stops the benchmark")
    parser.add_argument("--slo-ttft-ms", type=float, help="SLO on the time to first token (default: none)")
    parser.add_argument("--slo-tpot-ms", type=float, help="SLO on the time per output token (default: none)")
    parser.add_argument("--target-attainment", type=float, default=0.9,
                        help="the share of requests that must meet the SLO for a rate to pass")
    parser.add_argument("--sweep", action="store_true",
                        help="search the goodput upwards: the --request-rate values in ascending order, then "
                             "doublings of the highest up to --max-request-rate, until a rate misses the target; "
                             "then bisect between the last passing and the first failing rate")
    parser.add_argument("--max-request-rate", type=float, default=DEFAULT_MAX_RATE,
                        help="--sweep: where the doublings past the highest --request-rate stop")
    parser.add_argument("--bisect-steps", type=int, default=3,
                        help="--sweep: runs between the last passing and the first failing rate")
    parser.add_argument("--output", type=Path, help="JSON results")
    parser.add_argument("--output-details", action="store_true", help="per-request records in the JSON")
    parser.add_argument("--plot", type=Path, help="PNG of latency, failures and attainment against rate "
                                                  "(needs matplotlib: the bench extra)")
    parser.add_argument("--label", help="this run's name in plots (default: the JSON file's name)")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sweep and args.slo_ttft_ms is None and args.slo_tpot_ms is None:
        parser.error("--sweep needs --slo-ttft-ms and/or --slo-tpot-ms")
    if args.sweep and any(math.isinf(r) for r in args.request_rate):
        parser.error("--sweep needs finite --request-rate values")
    if args.plot and args.output is None:
        parser.error("--plot needs --output (the chart is drawn from the JSON)")
    if args.plot:
        require_matplotlib()
    return args


def build_plot_parser() -> argparse.ArgumentParser:
    parser = bench_parser("one chart of several result files", prog="python -m pdserve.bench.serving plot")
    parser.add_argument("results", type=Path, nargs="+", help="result files of the serving benchmark (--output)")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the PNG to write")
    return parser


def plot_main(argv: list[str]) -> None:
    args = build_plot_parser().parse_args(argv)
    print(plot_results(args.results, args.output))


def run(argv: list[str]) -> dict:
    args = parse_args(argv)
    result = benchmark(args)
    write_result(args.output, result)
    if args.plot:
        plot_results([args.output], args.plot)
    return result


def main(argv: list[str] | None = None) -> dict | None:
    return run_with_plot(argv, plot_main, run)


if __name__ == "__main__":
    main()
