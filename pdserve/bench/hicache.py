"""TTFT of a prompt whose prefix is recomputed, on the host tier, or in storage; host→device load rate (bytes
over the device time of the load's copies) against one contiguous copy of the same bytes (the copy ceiling).

python -m pdserve.bench.hicache --model-path DIR --input-len 16384 [--repeats 3] [--out FILE] \
    [engine flags, e.g. --hicache-storage-backend file --hicache-storage-dir /nvme/hicache]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from random import Random

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.cli import engine_bench_parser, parse_engine_bench_args
from pdserve.bench.hicache_copy import copy_ceilings


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ttft(llm: LLM, prompt: list[int]) -> float:
    _sync()
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    _sync()
    return time.perf_counter() - start


def measure(llm: LLM, prompt: list[int], tier: str, run: int) -> dict:
    """Time `prompt` plus one token: with nothing cached (`recompute`: a prompt never seen), or after its
    prefix was computed and moved to `tier` alone."""
    sched, radix = llm.scheduler, llm.scheduler.radix
    sched.flush_cache()
    if tier == "recompute":
        prompt = [t + 1 + run for t in prompt]  # shares no page with anything computed before
    else:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        radix.wait_for_writes(timeout=600)
        if tier == "host":
            radix.evict(radix.num_pages)
        else:
            sched.flush_cache()
    before = _load_counters(radix)
    seconds = ttft(llm, prompt + [prompt[0]])
    loaded, copy_seconds = (after - b for after, b in zip(_load_counters(radix), before))
    return {"tier": tier, "ttft_ms": seconds * 1e3, "loaded_bytes": loaded, "load_copy_ms": copy_seconds * 1e3}


def _load_counters(radix) -> tuple[float, float]:
    """Bytes loaded into the device and the device time of their copies, over every tier."""
    counters = radix.tier_stats()["hicache"]
    return (sum(counters["pdserve_hicache_loaded_bytes_total"].values()),
            sum(counters["pdserve_hicache_load_copy_seconds_total"].values()))


def build_parser() -> argparse.ArgumentParser:
    parser = engine_bench_parser(__doc__, "write the result as JSON here")
    parser.add_argument("--input-len", type=int, default=16384, help="tokens of the prompt whose KV is reloaded")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per tier")
    parser.add_argument("--warmup", type=int, default=1, help="runs per tier before the timed ones (kernels compile)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args, engine_args = parse_engine_bench_args(parser, argv)
    flags = {"enable_hierarchical_cache": True, **engine_args}
    llm = LLM(args.model_path, **flags)
    rng = Random(0)
    vocab = llm.scheduler.model_config.vocab_size
    prompt = [rng.randrange(3, min(vocab, 30000) - args.repeats) for _ in range(args.input_len)]
    tiers = ["recompute", "host"] + (["storage"] if llm.scheduler.radix.storage is not None else [])
    result: dict = {"input_len": args.input_len, "device": str(llm.scheduler.device), "tiers": {}}
    for tier in tiers:
        runs = [measure(llm, prompt, tier, run) for run in range(args.warmup + args.repeats)][args.warmup:]
        times = [r["ttft_ms"] for r in runs]
        result["tiers"][tier] = {"ttft_ms": statistics.median(times), "min_ttft_ms": min(times), "runs": runs}
    host = result["tiers"]["host"]
    nbytes = host["runs"][0]["loaded_bytes"]
    if nbytes:
        ceiling = copy_ceilings(nbytes, llm.scheduler.device, repeats=3)["h2d_gbps"] * 1e9
        load_ms = statistics.median(r["load_copy_ms"] for r in host["runs"])
        # the host TTFT also includes the one-token extend, so its rate is a lower bound of the load rate
        result.update(copy_ceiling_gbps=ceiling / 1e9, host_load_copy_ms=load_ms,
                      host_load_gbps_lower_bound=nbytes / host["min_ttft_ms"] * 1e3 / 1e9,
                      host_load_gbps=nbytes / load_ms * 1e3 / 1e9)
        result["host_load_fraction_of_ceiling"] = result["host_load_gbps"] / result["copy_ceiling_gbps"]
    for tier, r in result["tiers"].items():
        print(f"{tier:10s} TTFT {r['ttft_ms']:9.1f} ms median, {r['min_ttft_ms']:9.1f} ms best of {args.repeats} "
              f"({args.input_len}-token prompt, after {args.warmup} warm-up run(s))")
    if nbytes:
        print(f"host→device: {result['host_load_gbps']:.2f} GB/s over the copies' device time "
              f"({result['host_load_gbps_lower_bound']:.2f} GB/s over the whole TTFT) vs copy ceiling "
              f"{result['copy_ceiling_gbps']:.2f} GB/s: {result['host_load_fraction_of_ceiling']:.0%} "
              f"({nbytes / 1e6:.1f} MB)")
    llm.scheduler.radix.close()
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
