"""Multi-turn chat with the KV tiers off and with the host tier on (issue 12): each turn re-sends the whole
history, and all sessions together hold more history than the GPU pool (`--max-total-tokens`), so with the
tiers off an evicted history is recomputed and with the host tier it is loaded back.

One server per configuration, one after the other, each driven by `pdserve.bench.serving --dataset sessions`
(every session's next turn waits for its previous answer; at most --max-concurrency requests in flight).
Writes OUT/{tiers_off,host_tier}.json (the serving bench's results), OUT/server_*.log, OUT/multiturn.json (the
comparison, with each server's cache counters) and OUT/multiturn.png.

GPU (one H200, about 4 minutes with the llama-3.1-8b preset already built; built and cached first otherwise):
    python scripts/hicache_multiturn.py --out DIR [--model-path DIR]
CPU check with a tiny model:
    python scripts/hicache_multiturn.py --device cpu --preset llama-tiny --out DIR
Every size below has a per-device default (`DEFAULTS`); --server-args adds flags to both servers.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pdserve.ports import free_port
from pdserve.server_processes import ClusterError, Proc, http_url, server_argv, start_all

CONFIGS = ("tiers_off", "host_tier")
DEFAULTS = {  # workload and sizes per device
    "cuda": {"sessions": 32, "turns": 6, "system_len": 1024, "turn_input_len": 256, "turn_output_len": 32,
             "max_concurrency": 8, "max_total_tokens": 32768, "hicache_size": 16.0, "preset": "llama-3.1-8b"},
    "cpu": {"sessions": 6, "turns": 3, "system_len": 96, "turn_input_len": 32, "turn_output_len": 8,
            "max_concurrency": 2, "max_total_tokens": 640, "hicache_size": 0.01, "preset": "llama-tiny"},
}
SUMMARY_KEYS = ("completed", "errors", "duration_s", "request_throughput", "input_throughput", "output_throughput")
SERVER_KEYS = ("prefix_query_tokens", "prefix_hit_tokens", "num_retracted", "kv_total_tokens",
               "hicache_host_total_tokens")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=sorted(DEFAULTS), default="cuda")
    parser.add_argument("--model-path", help="model directory (default: the --preset, built and cached once)")
    parser.add_argument("--preset", help="pdserve.tools.make_model preset when no --model-path is given")
    for name, value in DEFAULTS["cuda"].items():
        if name != "preset":
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(value),
                                help=f"default {value} on cuda, {DEFAULTS['cpu'][name]} on cpu")
    parser.add_argument("--server-args", default="", help="more flags for both servers, one shell-quoted string")
    parser.add_argument("--startup-timeout", type=float, default=240.0, help="seconds for a server to be healthy")
    parser.add_argument("--run-timeout", type=float, default=150.0, help="seconds for one benchmark run")
    args = parser.parse_args(argv)
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def model_path(args: argparse.Namespace) -> str:
    if args.model_path:
        return args.model_path
    from pdserve.tools.make_model import default_model_dir

    log(f"model: the {args.preset} preset (built once into the pdserve cache; minutes for an 8B model)")
    return str(default_model_dir(args.preset))


def server_flags(args: argparse.Namespace, config: str) -> list[str]:
    flags = ["--max-total-tokens", str(args.max_total_tokens), *shlex.split(args.server_args)]
    if args.device == "cuda":
        flags += ["--cuda-graph-max-bs", str(max(args.max_concurrency, 8))]
    if config == "host_tier":
        flags += ["--enable-hierarchical-cache", "--hicache-size", str(args.hicache_size)]
    return flags


def bench_argv(args: argparse.Namespace, model: str, url: str, config: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.bench.serving", "--backend", "pdserve", "--base-url", url,
            "--tokenizer", model, "--dataset", "sessions", "--sessions", str(args.sessions),
            "--turns", str(args.turns), "--system-len", str(args.system_len),
            "--turn-input-len", str(args.turn_input_len), "--turn-output-len", str(args.turn_output_len),
            "--max-concurrency", str(args.max_concurrency), "--request-rate", "inf", "--disable-progress",
            "--request-timeout", str(args.run_timeout), "--label", config,
            "--output", str(args.out / f"{config}.json")]


def scheduler_stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/get_server_info", timeout=30) as response:
        return json.load(response)["scheduler"]


def run_config(args: argparse.Namespace, model: str, config: str) -> dict:
    """Start the server, run the sessions against it, read its counters, stop it."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")} if args.device == "cpu" else None
    proc = Proc(config, server_argv(model, port, *server_flags(args, config), device=args.device),
                http_url("127.0.0.1", port), env=env, log_path=str(args.out / f"server_{config}.log"))
    log(f"{config}: starting the server ({' '.join(proc.argv[3:])})")
    began = time.monotonic()
    start_all([proc], args.startup_timeout)
    try:
        log(f"{config}: healthy after {time.monotonic() - began:.0f} s; running {args.sessions} sessions x "
            f"{args.turns} turns")
        bench_log = args.out / f"bench_{config}.log"
        with open(bench_log, "w") as out:
            done = subprocess.run(bench_argv(args, model, proc.url, config), stdout=out, stderr=subprocess.STDOUT,
                                  timeout=args.run_timeout + 60)
        if done.returncode != 0:
            raise RuntimeError(f"{config}: the serving benchmark failed (rc {done.returncode}); "
                               f"end of {bench_log}:\n{bench_log.read_text()[-3000:]}")
        stats = scheduler_stats(proc.url)
    finally:
        proc.stop()
    run = json.loads((args.out / f"{config}.json").read_text())["runs"][0]
    if run["completed"] != run["requests"]:
        raise RuntimeError(f"{config}: {run['completed']} of {run['requests']} requests completed; "
                           f"errors {run['error_kinds']}, e.g. {run['error_examples'][:2]} (see {args.out})")
    return summarize(run, stats)


def summarize(run: dict, stats: dict) -> dict:
    server = {key: stats.get(key) for key in SERVER_KEYS}
    hicache = stats.get("hicache", {})
    server["host_hit_tokens"] = hicache.get("pdserve_hicache_hit_tokens_total", {}).get("host", 0)
    server["host_loaded_bytes"] = hicache.get("pdserve_hicache_loaded_bytes_total", {}).get("host", 0)
    queried = server["prefix_query_tokens"] or 0
    server["prefix_hit_fraction"] = server["prefix_hit_tokens"] / queried if queried else 0.0
    return {**{key: run[key] for key in SUMMARY_KEYS}, "ttft_ms": run["ttft_ms"], "tpot_ms": run["tpot_ms"],
            "e2e_ms": run["e2e_ms"], "server": server}


def compare(results: dict) -> dict:
    off, on = results["tiers_off"], results["host_tier"]
    return {
        "ttft_mean_speedup": off["ttft_ms"]["mean"] / on["ttft_ms"]["mean"],
        "ttft_p90_speedup": off["ttft_ms"]["p90"] / on["ttft_ms"]["p90"],
        "request_throughput_gain": on["request_throughput"] / off["request_throughput"],
        "host_tier_beats_tiers_off": (on["ttft_ms"]["mean"] < off["ttft_ms"]["mean"]
                                      and on["request_throughput"] > off["request_throughput"]),
    }


def plot(result: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = result["configs"]
    names = list(configs)
    panels = (
        ("TTFT (ms)", [("mean", lambda c: c["ttft_ms"]["mean"]), ("p50", lambda c: c["ttft_ms"]["p50"]),
                       ("p90", lambda c: c["ttft_ms"]["p90"])]),
        ("throughput (requests/s)", [("all turns", lambda c: c["request_throughput"])]),
        ("prompt tokens from cache (%)", [("all tiers", lambda c: 100 * c["server"]["prefix_hit_fraction"])]),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.6))
    for ax, (title, bars) in zip(axes, panels):
        width = 0.8 / len(bars)
        for i, (label, value) in enumerate(bars):
            xs = [k + (i - (len(bars) - 1) / 2) * width for k in range(len(names))]
            ax.bar(xs, [value(configs[n]) for n in names], width, label=label)
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    w = result["workload"]
    fig.suptitle(f"{w['sessions']} sessions x {w['turns']} turns, GPU pool {w['max_total_tokens']} tokens "
                 f"({result['device']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` too stops the server before exiting
    args.out.mkdir(parents=True, exist_ok=True)
    model = model_path(args)
    workload = {key: getattr(args, key) for key in DEFAULTS["cuda"] if key != "preset"}
    history = args.sessions * (args.system_len + args.turns * args.turn_input_len
                               + (args.turns - 1) * args.turn_output_len)
    log(f"workload: {workload}; {history} tokens of history in all against a {args.max_total_tokens}-token GPU pool")
    results = {}
    try:
        for config in CONFIGS:
            results[config] = run_config(args, model, config)
            r = results[config]
            log(f"{config}: {r['completed']} ok, {r['errors']} errors in {r['duration_s']:.1f} s; "
                f"TTFT mean {r['ttft_ms']['mean']:.1f} ms p90 {r['ttft_ms']['p90']:.1f} ms; "
                f"{r['request_throughput']:.2f} req/s; cache hits {100 * r['server']['prefix_hit_fraction']:.1f}%")
    except (ClusterError, RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
        log(f"FAILED: {exc}")
        return 1
    result = {"model": model, "device": args.device, "workload": workload, "history_tokens": history,
              "server_args": args.server_args, "configs": results, "comparison": compare(results)}
    (args.out / "multiturn.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "multiturn.png")
    c = result["comparison"]
    log(f"host tier vs tiers off: TTFT mean {c['ttft_mean_speedup']:.2f}x lower, p90 {c['ttft_p90_speedup']:.2f}x; "
        f"throughput {c['request_throughput_gain']:.2f}x -> {args.out / 'multiturn.json'}, multiturn.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
