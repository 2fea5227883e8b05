"""Offline throughput on the seeds' workload: 256 sequences, input and output lengths uniform in 100-1024,
random token ids, temperature 0.6, ignore_eos. Prints output tok/s and the run's HBM roofline fraction.

python -m pdserve.bench.offline --model-path DIR [--num-seqs 256] [--out DIR] [engine flags as --key value]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from random import Random

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.cli import engine_bench_parser, parse_engine_bench_args
from pdserve.bench.roofline import Ceilings, ModelCost, WorkCounters


def workload(num_seqs: int, min_len: int, max_len: int, vocab: int, seed: int = 0):
    rng = Random(seed)
    prompts = [[rng.randint(0, min(10000, vocab - 1)) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(min_len, max_len))
              for _ in range(num_seqs)]
    return prompts, params


def roofline(llm: LLM, work: WorkCounters, wall_s: float, ceilings: Ceilings) -> dict:
    """Ideal time = decode bytes / HBM bandwidth + prefill FLOPs / matmul rate, over the measured wall time."""
    cost = ModelCost.of(llm.scheduler.model_config, itemsize=llm.scheduler.runner.dtype.itemsize,
                        kv_itemsize=llm.scheduler.runner.pool.layout.itemsize)
    decode_bytes = work.decode_steps * cost.weight_bytes + work.decode_kv_tokens_read * cost.kv_bytes_per_token
    prefill_flops = cost.prefill_flops(work.extend_tokens, work.extend_attention_pairs)
    ideal_s = decode_bytes / (ceilings.hbm_gbps * 1e9) + prefill_flops / (ceilings.matmul_tflops * 1e12)
    return {"decode_bytes": decode_bytes, "prefill_flops": prefill_flops, "ideal_s": ideal_s,
            "roofline_fraction": ideal_s / wall_s, "work": asdict(work)}


def build_parser() -> argparse.ArgumentParser:
    parser = engine_bench_parser(__doc__, "write the result as JSON here (default: printed only)")
    parser.add_argument("--num-seqs", type=int, default=256, help="sequences generated in one batch")
    parser.add_argument("--min-len", type=int, default=100, help="shortest prompt and output, tokens")
    parser.add_argument("--max-len", type=int, default=1024, help="longest prompt and output, tokens")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args, engine_args = parse_engine_bench_args(parser, argv)
    llm = LLM(args.model_path, **engine_args)
    prompts, params = workload(args.num_seqs, args.min_len, args.max_len, llm.scheduler.model_config.vocab_size)
    llm.generate(["Benchmark warm-up: "], SamplingParams(max_tokens=8), use_tqdm=False)
    work = WorkCounters()
    llm.scheduler.runner.forward_observers.append(work.observe)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    total_out = sum(len(o.token_ids) for o in outputs)
    result = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model_path, "engine_args": engine_args, "num_seqs": args.num_seqs,
        "input_tokens": sum(map(len, prompts)), "output_tokens": total_out, "wall_s": wall,
        "output_tok_per_s": total_out / wall,
        "attention_backend": llm.scheduler.runner.backend_name,
        "cuda_graphs": llm.scheduler.runner.graph_runner is not None,
    }
    if torch.cuda.is_available():
        ceilings = Ceilings.measure()
        result["ceilings"] = asdict(ceilings)
        result.update(roofline(llm, work, wall, ceilings))
    print(f"Total: {total_out} tok, Time: {wall:.2f} s, Throughput: {total_out / wall:.1f} tok/s")
    if "roofline_fraction" in result:
        print(f"HBM/compute roofline: ideal {result['ideal_s']:.2f} s -> {100 * result['roofline_fraction']:.1f}% "
              f"(HBM {result['ceilings']['hbm_gbps']:.0f} GB/s, bf16 {result['ceilings']['matmul_tflops']:.0f} TFLOP/s)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "offline.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
