"""PD end to end: greedy output through the router and prefill -> decode equals a colocated server, per
transfer backend; and the TTFT that PD adds over colocated at concurrency 1 (median of --reps).

GPU (prefill on GPU 0, decode on GPU 1):
    python scripts/pd_check.py --model-path DIR --backends mooncake nccl --out DIR
CPU (the fixed cost of the extra hops, control messages and scheduler wake-ups, with a tiny model):
    python scripts/pd_check.py --device cpu --model-path DIR --backends tcp mooncake --identity-lens 5 60 300 \
        --ttft-lens 16 256 --reps 30 --out DIR
--server-flags go to every server, colocated and both roles alike: e.g. "--kv-cache-dtype fp8_e4m3
--quantization fp8" measures the handoff of FP8 pages (half the bytes a token) against a colocated FP8 server.
--pd-flags go to the prefill and the decode only, after the others: "--tp-size 2 --base-gpu-id 0" puts both roles
at TP 2 on GPUs 0 and 1; --reference-flags to the colocated server only. Greedy identity is exact only where both
roles compute as the reference does: in bf16, PD TP 2 -> TP 2 against a colocated TP 2 server (--reference-flags
"--tp-size 2 --base-gpu-id 0"), while against TP 1 only float32 (--server-flags "--dtype float32") can be held to
identity. Every variant reports, per prompt, whether its output is identical and the first output position where it
differs (None: identical), whether both KV pools are free after it (also after a failure), and on a failure the
HTTP error's body and the servers' and router's error lines. Exit code 1 when a variant is not identical everywhere
with both pools free.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pdserve.ports import free_port
from pdserve.server_processes import (Proc, decode_flags, http_url, pd_router_flags, prefill_flags,
                                      router_argv, server_argv, start_all, stop_all)

STARTUP_TIMEOUT_S = 480.0
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
SIZE_FLAGS = {"cuda": ["--max-total-tokens", "131072", "--context-length", "20000", "--cuda-graph-max-bs", "16"],
              "cpu": ["--max-total-tokens", "4096", "--context-length", "512"]}
ERROR_MARKS = ("error", "traceback", "refus", "failed")  # in a log line (lower-cased) that reports a failure
# on the CPU one intra-op thread per process: the servers share the cores, and oversubscription slows each token
CPU_ENV = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def server(name: str, model: str, device: str, gpu: int, logs: Path, *flags: str) -> Proc:
    """A server on GPU `gpu` (or the CPU) on loopback, its whole log kept in `logs`."""
    port = free_port()
    argv = server_argv(model, port, *SIZE_FLAGS[device], *flags, device=device, gpu=gpu if device == "cuda" else None)
    return Proc(name, argv, http_url("127.0.0.1", port), env=CPU_ENV if device == "cpu" else None,
                log_path=str(logs / f"{name}.log"))


def router(name: str, prefill: Proc, bootstrap_port: int, decode: Proc, logs: Path) -> Proc:
    port = free_port()
    argv = router_argv(port, "--log-level", "warning", *pd_router_flags([(prefill.url, bootstrap_port)], [decode.url]))
    return Proc(name, argv, http_url("127.0.0.1", port), log_path=str(logs / f"{name}.log"))


def generate(url: str, body: dict) -> dict:
    req = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def ttft_ms(url: str, ids: list[int]) -> float:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
            "stream": True}
    req = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            if line.startswith(b"data: ") and b"[DONE]" not in line:
                first = time.perf_counter()
                resp.read()
                return 1e3 * (first - start)
    raise RuntimeError("no token streamed")


def http_error(exc: Exception) -> str:
    """The exception in words; for an HTTP error also its status and the JSON body the server or router sent."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:2000]}"
    return repr(exc)


def error_lines(proc: Proc, limit: int = 20) -> list[str]:
    """The last `limit` lines of `proc`'s whole log that report a failure (not the tail, where start-up lines
    can crowd them out)."""
    try:
        with open(proc.log_path, errors="replace") as f:
            lines = [line.rstrip()[:600] for line in f if any(k in line.lower() for k in ERROR_MARKS)]
    except OSError:
        return []
    return lines[-limit:]


def first_divergences(got: list[list[int]], expected: list[list[int]]) -> list[int | None]:
    """Per prompt, the first output position where `got` differs from `expected` (a shorter output differs where it
    ends); None where they are identical."""
    out = []
    for g, e in zip(got, expected):
        out.append(None if g == e else next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), min(len(g), len(e))))
    return out


def pools_free(urls: list[str], timeout_s: float = 30.0) -> bool:
    """Each server's KV pool fully free once its prefix cache is flushed (asked again until `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        free = []
        for url in urls:
            try:  # refused while requests are in flight: asked again
                urllib.request.urlopen(urllib.request.Request(f"{url}/flush_cache", method="POST"), timeout=10).read()
            except urllib.error.HTTPError:
                pass
            info = json.loads(urllib.request.urlopen(f"{url}/get_server_info", timeout=10).read())
            free.append(bool(info.get("scheduler", {}).get("kv_pool_fully_free")))
        if all(free) or time.monotonic() > deadline:
            return all(free)
        time.sleep(0.5)


@dataclass(slots=True)
class Plan:
    """What every variant is measured on: the identity prompts and the reference's outputs for them, the TTFT
    prompt lengths and samples, the random ids' source and the colocated TTFT to subtract."""

    args: argparse.Namespace
    prompts: list[list[int]]
    expected: list[list[int]]
    vocab: int
    rng: random.Random
    colocated_ttft_ms: dict[int, float]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--backends", nargs="+", default=["mooncake", "nccl"])
    parser.add_argument("--identity-lens", type=int, nargs="+", default=[5, 300, 2000, 9000])
    parser.add_argument("--reps", type=int, default=5, help="TTFT samples per prompt length (the median is kept)")
    parser.add_argument("--ttft-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--chunk-push-too", action="store_true",
                        help="also run each backend with --disaggregation-layerwise-min-tokens 0 (KV pushed after "
                             "each chunk's forward instead of layer by layer during it)")
    parser.add_argument("--server-flags", default="", help="flags for every server (colocated, prefill, decode)")
    parser.add_argument("--pd-flags", default="", help="flags for the prefill and the decode only, after the others")
    parser.add_argument("--reference-flags", default="",
                        help="flags for the colocated reference server only, after the others")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    common, reference = shlex.split(args.server_flags), shlex.split(args.reference_flags)
    rng = random.Random(0)
    vocab = json.loads((Path(args.model_path) / "config.json").read_text())["vocab_size"]
    prompts = [[rng.randrange(100, vocab) for _ in range(n)] for n in args.identity_lens]
    logs = args.out / "logs"  # every process's whole log, kept
    logs.mkdir(parents=True, exist_ok=True)
    colocated = start_all([server("colocated", args.model_path, args.device, 0, logs, *common, *reference)],
                          STARTUP_TIMEOUT_S)[0]
    report = {"model": args.model_path, "server_flags": common, "pd_flags": shlex.split(args.pd_flags),
              "reference_flags": reference, "backends": {}}
    try:
        expected = [generate(colocated.url, {"input_ids": p, "sampling_params": GREEDY})["output_ids"] for p in prompts]
        colo_ttft = {n: [ttft_ms(colocated.url, [rng.randrange(100, vocab) for _ in range(n)])
                         for _ in range(args.reps)] for n in args.ttft_lens}
        report["colocated_ttft_ms"] = {n: statistics.median(v) for n, v in colo_ttft.items()}
        plan = Plan(args, prompts, expected, vocab, rng, report["colocated_ttft_ms"])
        variants: list[tuple[str, str, list[str]]] = [(b, b, []) for b in args.backends]
        if args.chunk_push_too:
            variants += [(f"{b}+chunk-push", b, ["--disaggregation-layerwise-min-tokens", "0"]) for b in args.backends]
        for name, backend, extra in variants:
            report["backends"][name] = check_variant(plan, name, backend, extra)
            print_variant(name, report["backends"][name])
    finally:
        stop_all([colocated])
    (args.out / f"pd_{args.device}.json").write_text(json.dumps(report, indent=2, default=str))
    print("colocated TTFT ms", report["colocated_ttft_ms"])
    verdicts = {name: passed(result) for name, result in report["backends"].items()}
    print("RESULT", " ".join(f"{name}={'PASS' if ok else 'FAIL'}" for name, ok in verdicts.items()), flush=True)
    sys.exit(0 if all(verdicts.values()) else 1)


def check_variant(plan: Plan, name: str, backend: str, extra: list[str]) -> dict:
    """One PD variant against the reference; never raises: what failed is in the result, with the pools' state after
    it and the processes' error lines."""
    args = plan.args
    common, roles = shlex.split(args.server_flags), shlex.split(args.pd_flags)
    bport, logs = free_port(), args.out / "logs"
    p = server(f"prefill-{name}", args.model_path, args.device, 0, logs, *prefill_flags(backend, bport), *extra,
               *common, *roles)
    d = server(f"decode-{name}", args.model_path, args.device, 1, logs, *decode_flags(backend), *common, *roles)
    r = router(f"router-{name}", p, bport, d, logs)
    try:
        start_all([p, d], STARTUP_TIMEOUT_S)
        start_all([r], STARTUP_TIMEOUT_S)
        result = measure(plan, r.url)
        result["prefill_server_info"] = json.loads(urllib.request.urlopen(f"{p.url}/get_server_info",
                                                                          timeout=10).read())
    except Exception as exc:  # keep going with the next backend; the report says what failed
        result = {"error": http_error(exc)}
    try:  # a failed request must not leak pages either
        result["pools_free"] = pools_free([p.url, d.url])
    except Exception as exc:
        result["pools_free"] = f"unknown: {exc!r}"
    result["error_lines"] = {proc.name: error_lines(proc) for proc in (p, d, r)}
    stop_all([r, p, d])  # again after a failed start: a no-op for the stopped ones
    return result


def measure(plan: Plan, url: str) -> dict:
    got = [generate(url, {"input_ids": q, "sampling_params": GREEDY})["output_ids"] for q in plan.prompts]
    batch = generate(url, {"input_ids": plan.prompts, "sampling_params": GREEDY})
    batch_ids = [item["output_ids"] for item in batch]
    pd_ttft = {n: statistics.median(ttft_ms(url, [plan.rng.randrange(100, plan.vocab) for _ in range(n)])
                                    for _ in range(plan.args.reps)) for n in plan.args.ttft_lens}
    return {
        "identical": [g == e for g, e in zip(got, plan.expected)],
        "first_divergence": first_divergences(got, plan.expected),
        "batch_identical": [g == e for g, e in zip(batch_ids, plan.expected)],
        "batch_first_divergence": first_divergences(batch_ids, plan.expected),
        "pd_ttft_ms": pd_ttft,
        "added_ttft_ms": {n: pd_ttft[n] - plan.colocated_ttft_ms[n] for n in pd_ttft},
    }


def passed(result: dict) -> bool:
    return ("error" not in result and all(result["identical"]) and all(result["batch_identical"])
            and result["pools_free"] is True)


def print_variant(name: str, result: dict) -> None:
    shown = {k: v for k, v in result.items() if k not in ("prefill_server_info", "error_lines")}
    print(name, json.dumps(shown, indent=1), flush=True)
    for proc_name, lines in result["error_lines"].items():
        for line in lines:
            print(f"  [{proc_name}] {line}", flush=True)


if __name__ == "__main__":
    main()
