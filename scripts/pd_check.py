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
at TP 2 on GPUs 0 and 1, against a colocated TP 1 server; every variant also reports whether both KV pools are free
after it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import time
import urllib.error
import urllib.request
from pathlib import Path

from pdserve.server_processes import (Proc, decode_flags, free_port, http_url, pd_router_flags, prefill_flags,
                                      router_argv, server_argv, start_all, stop_all)

STARTUP_TIMEOUT_S = 480.0
SIZE_FLAGS = {"cuda": ["--max-total-tokens", "131072", "--context-length", "20000", "--cuda-graph-max-bs", "16"],
              "cpu": ["--max-total-tokens", "4096", "--context-length", "512"]}
# on the CPU one intra-op thread per process: the servers share the cores, and oversubscription slows each token
CPU_ENV = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def server(name: str, model: str, device: str, gpu: int, *flags: str) -> Proc:
    """A server on GPU `gpu` (or the CPU) on loopback."""
    port = free_port()
    argv = server_argv(model, port, *SIZE_FLAGS[device], *flags, device=device, gpu=gpu if device == "cuda" else None)
    return Proc(name, argv, http_url("127.0.0.1", port), env=CPU_ENV if device == "cpu" else None)


def router(prefill: Proc, bootstrap_port: int, decode: Proc) -> Proc:
    port = free_port()
    argv = router_argv(port, "--log-level", "warning", *pd_router_flags([(prefill.url, bootstrap_port)], [decode.url]))
    return Proc("router", argv, http_url("127.0.0.1", port))


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


def main() -> None:
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
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    common = shlex.split(args.server_flags)
    roles = shlex.split(args.pd_flags)
    rng = random.Random(0)
    vocab = json.loads((Path(args.model_path) / "config.json").read_text())["vocab_size"]
    prompts = [[rng.randrange(100, vocab) for _ in range(n)] for n in args.identity_lens]
    greedy = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    colocated = start_all([server("colocated", args.model_path, args.device, 0, *common)], STARTUP_TIMEOUT_S)[0]
    report = {"model": args.model_path, "server_flags": common, "pd_flags": roles, "backends": {}}
    try:
        expected = [generate(colocated.url, {"input_ids": p, "sampling_params": greedy})["output_ids"] for p in prompts]
        colo_ttft = {n: [ttft_ms(colocated.url, [rng.randrange(100, vocab) for _ in range(n)])
                         for _ in range(args.reps)] for n in args.ttft_lens}
        report["colocated_ttft_ms"] = {n: statistics.median(v) for n, v in colo_ttft.items()}
        variants: list[tuple[str, str, list[str]]] = [(b, b, []) for b in args.backends]
        if args.chunk_push_too:
            variants += [(f"{b}+chunk-push", b, ["--disaggregation-layerwise-min-tokens", "0"]) for b in args.backends]
        for name, backend, extra in variants:
            bport = free_port()
            p = server(f"prefill-{name}", args.model_path, args.device, 0, *prefill_flags(backend, bport), *extra,
                       *common, *roles)
            d = server(f"decode-{name}", args.model_path, args.device, 1, *decode_flags(backend), *common, *roles)
            procs = start_all([p, d], STARTUP_TIMEOUT_S)
            r = start_all([router(p, bport, d)], STARTUP_TIMEOUT_S)[0]
            try:
                got = [generate(r.url, {"input_ids": q, "sampling_params": greedy})["output_ids"] for q in prompts]
                batch = generate(r.url, {"input_ids": prompts, "sampling_params": greedy})
                batch_ids = [item["output_ids"] for item in batch]
                pd_ttft = {n: statistics.median(ttft_ms(r.url, [rng.randrange(100, vocab) for _ in range(n)])
                                                for _ in range(args.reps)) for n in args.ttft_lens}
                info = json.loads(urllib.request.urlopen(f"{p.url}/get_server_info", timeout=10).read())
                report["backends"][name] = {
                    "identical": [g == e for g, e in zip(got, expected)],
                    "batch_identical": [g == e for g, e in zip(batch_ids, expected)],
                    "pd_ttft_ms": pd_ttft,
                    "added_ttft_ms": {n: pd_ttft[n] - report["colocated_ttft_ms"][n] for n in args.ttft_lens},
                    "prefill_server_info": info,
                    "pools_free": pools_free([p.url, d.url]),
                }
            except Exception as exc:  # keep going with the next backend; the report says what failed
                report["backends"][name] = {"error": repr(exc), "prefill_log": p.log()[-3000:],
                                               "decode_log": d.log()[-3000:]}
            finally:
                stop_all([r, *procs])
            print(name, json.dumps({k: v for k, v in report["backends"][name].items()
                                       if k != "prefill_server_info"}, indent=1)[:3000], flush=True)
    finally:
        stop_all([colocated])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"pd_{args.device}.json").write_text(json.dumps(report, indent=2, default=str))
    print("colocated TTFT ms", report["colocated_ttft_ms"])


if __name__ == "__main__":
    main()
