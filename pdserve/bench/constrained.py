"""Constrained decoding against unconstrained: the same requests, free and under a JSON schema, at each batch size.

    python -m pdserve.bench.constrained --base-url http://127.0.0.1:30000 --batch-sizes 1 64 --input-len 512 \\
        --output-len 256 --repeats 3 --output constrained.json --plot constrained.png
    python -m pdserve.bench.constrained plot constrained.json -o constrained.png

For each batch size B: --num-prompts requests (default B) of exactly --input-len prompt tokens, sent all at once
with at most B in flight, each generating exactly --output-len tokens: free with ignore_eos, and constrained by a
JSON schema that cannot end sooner (an array of integers whose minItems is the output length), so both modes
decode the same number of steps. Every request is the same in both modes; the runs interleave (free,
constrained, free, ... --repeats times each) so drift hits both alike, after a pass that puts the prompts in the
prefix cache. Reported per batch size: TPOT p50/p90 of each mode over all its runs, their ratio
constrained / free, and whether every output had the asked length.

First compile: a 20-property object schema the server has not seen (its property names carry a fresh nonce) is
sent twice, one request after the other; TTFT of the first minus TTFT of the second is what the compile added,
next to the server's own compile time (`grammar_compile_seconds` of /get_server_info's scheduler stats, else
pdserve_grammar_compile_seconds of /metrics). The warm-up has already compiled a grammar, so the tokenizer's
one-time preparation is not in it. --compile-repeats fresh schemas are measured: the first pays for rules no grammar
had before (xgrammar keeps those across grammars), the later ones differ from it in names only, so they are
reported apart. Compiling is host CPU work.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
import urllib.request
import uuid
from pathlib import Path

import aiohttp

from pdserve.bench.cli import bench_parser, run_with_plot, write_result
from pdserve.bench.client import ClientConfig, RequestResult, merge_extra_body, send
from pdserve.bench.datasets import BenchRequest, PromptBuilder
from pdserve.bench.loadgen import LoadRun
from pdserve.bench.plots import require_matplotlib, save_figure
from pdserve.bench.serving import add_target_args, client_config, model_info, prompt_builder, server_json
from pdserve.bench.stats import Slo, error_lines, summarize

MODES = ("free", "constrained")
COMPILE_PROPERTIES = 20
COMPILE_METRICS = ("grammar_compiles", "grammar_cache_hits", "grammar_compile_seconds")


def endless_array_schema(output_len: int) -> dict:
    """Integers, at least `output_len` of them: with Llama-3/Qwen-style pre-tokenization no token holds digits and a
    comma, so each integer takes a token of its own and the grammar cannot end before max_new_tokens does."""
    return {"type": "array", "items": {"type": "integer"}, "minItems": output_len}


def compile_schema(nonce: str) -> dict:
    """An object of 20 required properties of every common kind; `nonce` in the names makes its text new."""
    kinds = [
        {"type": "string", "maxLength": 32}, {"type": "integer", "minimum": 0, "maximum": 1000},
        {"type": "number"}, {"type": "boolean"}, {"enum": ["red", "green", "blue"]},
        {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]},
        {"type": "string", "pattern": "[a-z]{2,8}"}, {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        {"type": "string", "format": "date"},
    ]
    names = [f"field_{index}_{nonce}" for index in range(COMPILE_PROPERTIES)]
    return {"type": "object", "properties": {name: kinds[i % len(kinds)] for i, name in enumerate(names)},
            "required": names, "additionalProperties": False}


def constraint_body(backend: str, schema: dict) -> dict:
    """What a request adds to be held to `schema`: SGLang's json_schema sampling parameter on `/generate`,
    OpenAI's response_format elsewhere."""
    if backend in ("pdserve", "sglang"):
        return {"sampling_params": {"json_schema": json.dumps(schema)}}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}}


def constrained_config(config: ClientConfig, schema: dict) -> ClientConfig:
    extra = merge_extra_body(config.extra_body, constraint_body(config.backend, schema))
    return dataclasses.replace(config, extra_body=extra)


def run_batch(config: ClientConfig, requests: list[BenchRequest], batch_size: int, label: str,
              progress: bool) -> tuple[list[RequestResult], float]:
    load = LoadRun(config, requests, [0.0] * len(requests), batch_size, progress=progress, description=label)
    return asyncio.run(load.run())


def mode_summary(runs: list[tuple[list[RequestResult], float]], output_len: int) -> dict:
    """One mode's runs at one batch size: the pooled summary, each run's TPOT p50, the output lengths seen."""
    results = [r for run, _ in runs for r in run]
    summary = summarize(results, sum(duration for _, duration in runs), Slo())
    lengths = sorted({r.output_len for r in results if r.success})
    return {**summary, "run_tpot_p50_ms": [summarize(run, d, Slo())["tpot_ms"]["p50"] for run, d in runs],
            "output_lens": lengths, "all_output_len": lengths == [output_len] and not summary["errors"]}


def ratio(constrained: float | None, free: float | None) -> float | None:
    return constrained / free if constrained is not None and free else None


def measure_batch(configs: dict[str, ClientConfig], requests: list[BenchRequest], batch_size: int,
                  args: argparse.Namespace) -> dict:
    """Prime the prefix cache with the prompts, then the interleaved runs of both modes."""
    prime = [dataclasses.replace(r, output_len=1) for r in requests]
    run_batch(configs["free"], prime, batch_size, f"B={batch_size} prime", False)
    runs: dict[str, list] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode in MODES:
            label = f"B={batch_size} {mode} {repeat + 1}/{args.repeats}"
            runs[mode].append(run_batch(configs[mode], requests, batch_size, label, not args.disable_progress))
    modes = {mode: mode_summary(runs[mode], args.output_len) for mode in MODES}
    free, constrained = modes["free"]["tpot_ms"], modes["constrained"]["tpot_ms"]
    return {"batch_size": batch_size, "num_prompts": len(requests), "modes": modes,
            "tpot_ratio_p50": ratio(constrained["p50"], free["p50"]),
            "tpot_ratio_p90": ratio(constrained["p90"], free["p90"]),
            "output_lens_equal": modes["free"]["output_lens"] == modes["constrained"]["output_lens"]
                                 and all(m["all_output_len"] for m in modes.values())}


def grammar_counters(args: argparse.Namespace) -> dict | None:
    """The server's compile counters: /get_server_info's scheduler stats (pdserve), else /metrics; None where
    the target exports neither (a router that does not pass them on)."""
    scheduler = (server_json(args, "/get_server_info") or {}).get("scheduler") or {}
    if all(name in scheduler for name in COMPILE_METRICS):
        return {name: float(scheduler[name]) for name in COMPILE_METRICS}
    return metrics_counters(args)


def metrics_counters(args: argparse.Namespace) -> dict | None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    request = urllib.request.Request(args.base_url.rstrip("/") + "/metrics", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
    except OSError:
        return None
    found = {name: parse_counter(text, "pdserve_" + name) for name in COMPILE_METRICS}
    return None if None in found.values() else found


def parse_counter(text: str, name: str) -> float | None:
    """The sum of a Prometheus family's samples (`name` or `name_total`, any labels); None where it is absent."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.split("{", 1)[0].split(" ", 1)[0] in (name, name + "_total")]
    return sum(values) if values else None


async def send_one_after_another(config: ClientConfig, requests: list[BenchRequest]) -> list[RequestResult]:
    async with aiohttp.ClientSession() as session:
        return [await send(session, config, request) for request in requests]


def first_compile(config: ClientConfig, builder: PromptBuilder, args: argparse.Namespace) -> dict:
    """One fresh 20-property schema, sent twice in a row: the compile it costs, by TTFT and by the server."""
    config = constrained_config(config, compile_schema(uuid.uuid4().hex[:12]))
    requests = [BenchRequest(builder.prompt(args.input_len), args.input_len, args.compile_output_len)
                for _ in range(2)]
    before = grammar_counters(args)
    first, second = asyncio.run(send_one_after_another(config, requests))
    after = grammar_counters(args)
    errors = [r.error for r in (first, second) if not r.success]
    if errors:
        raise SystemExit(f"the first-compile requests failed: {'; '.join(errors)}")
    server = None if before is None or after is None else {name: after[name] - before[name] for name in before}
    return {"ttft_first_ms": 1000 * first.ttft, "ttft_second_ms": 1000 * second.ttft,
            "compile_latency_ms": 1000 * (first.ttft - second.ttft),
            "server_compile_ms": None if server is None else 1000 * server["grammar_compile_seconds"],
            "server_counters_delta": server}


def warm_up(configs: dict[str, ClientConfig], builder: PromptBuilder, args: argparse.Namespace) -> None:
    """A few requests of each mode (other words, same shapes): CUDA graphs, the grammar compiler's tokenizer
    tables and the endless schema's compile are all ready before anything is timed."""
    requests = [BenchRequest(builder.prompt(args.input_len), args.input_len, args.output_len)
                for _ in range(args.warmup_requests)]
    for mode in MODES:
        results, duration = run_batch(configs[mode], requests, len(requests), f"warm-up {mode}", False)
        summary = summarize(results, duration, Slo())
        if summary["errors"]:
            raise SystemExit(f"warm-up ({mode}) failed: {summary['errors']} of {summary['requests']} requests\n  "
                             + "\n  ".join(error_lines(summary)))


def compile_summary(samples: list[dict]) -> dict:
    """The first sample apart: xgrammar keeps what it built for a rule (a maxLength string's pattern, ...) across
    grammars, so only the first schema pays for rules no grammar had before; the later ones differ in names."""
    later = samples[1:]
    server = [s["server_compile_ms"] for s in later if s["server_compile_ms"] is not None]
    return {"properties": COMPILE_PROPERTIES, "samples": samples,
            "first_compile_latency_ms": samples[0]["compile_latency_ms"],
            "first_server_compile_ms": samples[0]["server_compile_ms"],
            "later_compile_latency_ms_median": statistics.median(s["compile_latency_ms"] for s in later)
                                               if later else None,
            "later_server_compile_ms_median": statistics.median(server) if server else None}


def benchmark(args: argparse.Namespace) -> dict:
    info = model_info(args)
    config = client_config(args, info)
    builder = prompt_builder(args, info)
    configs = {"free": config, "constrained": constrained_config(config, endless_array_schema(args.output_len))}
    warm_up(configs, builder, args)
    batches = []
    for batch_size in args.batch_sizes:
        builder.reseed(batch_size)
        count = args.num_prompts or batch_size
        requests = [BenchRequest(builder.prompt(args.input_len), args.input_len, args.output_len)
                    for _ in range(count)]
        batches.append(measure_batch(configs, requests, batch_size, args))
    compile_samples = [first_compile(config, builder, args) for _ in range(args.compile_repeats)]
    return {"label": args.label, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "backend": args.backend,
            "model": config.model or info.get("model_path") or info.get("id"), "base_url": args.base_url,
            "input_len": args.input_len, "output_len": args.output_len, "repeats": args.repeats,
            "schema": endless_array_schema(args.output_len), "batches": batches,
            "first_compile": compile_summary(compile_samples),
            "client": {k: v for k, v in dataclasses.asdict(config).items() if k != "api_key"}}


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(result: dict) -> str:
    lines = [f"{'batch':>5} {'mode':>12} {'ok':>9} {'TPOT p50':>9} {'TPOT p90':>9} {'out len':>8}   ratio p50/p90"]
    for batch in result["batches"]:
        for mode in MODES:
            m = batch["modes"][mode]
            ratios = (f"   {fmt(batch['tpot_ratio_p50'], '.3f')} / {fmt(batch['tpot_ratio_p90'], '.3f')}"
                      if mode == "constrained" else "")
            lines.append(f"{batch['batch_size']:>5} {mode:>12} {m['completed']:>4}/{m['requests']:<4} "
                         f"{fmt(m['tpot_ms']['p50'], '9.2f')} {fmt(m['tpot_ms']['p90'], '9.2f')} "
                         f"{','.join(map(str, m['output_lens'])) or '-':>8}{ratios}")
        equal = "equal" if batch["output_lens_equal"] else "NOT EQUAL (see output_lens)"
        lines.append(f"{'':>5} output lengths of both modes: {equal}")
    compile_ = result["first_compile"]
    lines.append(f"first compile of a {compile_['properties']}-property schema: "
                 f"{fmt(compile_['first_compile_latency_ms'], '.1f')} ms by TTFT, "
                 f"{fmt(compile_['first_server_compile_ms'], '.1f')} ms by the server; later fresh schemas of the "
                 f"same rules: {fmt(compile_['later_compile_latency_ms_median'], '.1f')} ms by TTFT, "
                 f"{fmt(compile_['later_server_compile_ms_median'], '.1f')} ms by the server (medians of "
                 f"{len(compile_['samples']) - 1})")
    return "\n".join(lines)


def plot(result: dict, out: Path) -> Path:
    """TPOT p50 and p90 of both modes against batch size, and the ratio constrained / free; y from zero."""
    require_matplotlib()
    import matplotlib.pyplot as plt

    sizes = [b["batch_size"] for b in result["batches"]]
    positions = range(len(sizes))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for offset, (mode, pct) in enumerate((m, p) for m in MODES for p in ("p50", "p90")):
        values = [b["modes"][mode]["tpot_ms"][pct] or 0.0 for b in result["batches"]]
        axes[0].bar([x + (offset - 1.5) * 0.2 for x in positions], values, 0.2, label=f"{mode} {pct}")
    axes[0].set_ylabel("TPOT (ms)")
    for pct, marker in (("p50", "o"), ("p90", "s")):
        axes[1].plot(list(positions), [b[f"tpot_ratio_{pct}"] or 0.0 for b in result["batches"]], marker=marker,
                     label=f"{pct} constrained / free")
    axes[1].axhline(1.15, color="grey", linestyle="--", linewidth=0.8, label="1.15")
    axes[1].set_ylabel("TPOT ratio")
    for ax in axes:
        ax.set_xticks(list(positions), [str(s) for s in sizes])
        ax.set_xlabel("batch size")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    compile_ms = result["first_compile"]["first_compile_latency_ms"]
    fig.suptitle(f"constrained vs free decoding, {result.get('label') or ''} {result['model']}, {result['date']}\n"
                 f"in {result['input_len']} / out {result['output_len']} tokens; first compile of a "
                 f"{COMPILE_PROPERTIES}-property schema {compile_ms:.1f} ms", fontsize=10)
    return save_figure(fig, out)


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__)
    add_target_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64],
                        help="requests in flight at once, one measurement each")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens of every request")
    parser.add_argument("--output-len", type=int, default=256, help="output tokens of every request")
    parser.add_argument("--num-prompts", type=int, help="requests per run (default: the batch size, one wave)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode per batch size, interleaved")
    parser.add_argument("--warmup-requests", type=int, default=2, help="requests of each mode sent first, not counted")
    parser.add_argument("--compile-repeats", type=int, default=3,
                        help="first-compile measurements, each with a fresh schema: the first alone, the median of "
                             "the others")
    parser.add_argument("--compile-output-len", type=int, default=8, help="output tokens of the first-compile requests")
    parser.add_argument("--output", type=Path, help="JSON results")
    parser.add_argument("--plot", type=Path, help="PNG of TPOT and the ratio against batch size (needs matplotlib)")
    parser.add_argument("--label", help="this run's name in the JSON")
    parser.add_argument("--disable-progress", action="store_true", help="no progress bar")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.disable_ignore_eos:
        parser.error("--disable-ignore-eos would let the free requests stop early: both modes must run to "
                     "--output-len")
    for name in ("input_len", "output_len", "repeats", "compile_repeats", "compile_output_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.output_len < 2:
        parser.error("--output-len must be at least 2 (TPOT needs two tokens)")
    if min(args.batch_sizes) < 1 or (args.num_prompts is not None and args.num_prompts < 1):
        parser.error("--batch-sizes and --num-prompts must be at least 1")
    if args.plot:
        require_matplotlib()
    return args


def plot_main(argv: list[str]) -> None:
    parser = bench_parser("the chart of a result file", prog="python -m pdserve.bench.constrained plot")
    parser.add_argument("result", type=Path, help="a result file of this benchmark (--output)")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    print(plot(json.loads(args.result.read_text()), args.output))


def run(argv: list[str]) -> dict:
    args = parse_args(argv)
    result = benchmark(args)
    print(table(result))
    write_result(args.output, result)
    if args.plot:
        print(plot(result, args.plot))
    return result


def main(argv: list[str] | None = None) -> dict | None:
    return run_with_plot(argv, plot_main, run)


if __name__ == "__main__":
    main()
