"""One static batch: TTFT, time between tokens and throughput over a grid of batch size x input x output length,
each with its roofline (prefill FLOPs over the bf16 matmul rate; decode bytes over HBM bandwidth).

python -m pdserve.bench.one_batch --model-path DIR --batch-sizes 1 64 --input-lens 1024 --output-lens 64 [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import asdict
from random import Random

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.cli import engine_bench_parser, parse_engine_bench_args
from pdserve.bench.roofline import Ceilings, ModelCost
from pdserve.scheduler.request import Req


def add_static_batch(sched, bs: int, input_len: int, max_tokens: int, tag: str) -> None:
    """bs greedy requests of input_len random token ids (seeded by the shape), each generating max_tokens."""
    rng = Random(bs * 7919 + input_len)
    vocab = min(10000, sched.model_config.vocab_size - 1)
    for i in range(bs):
        ids = [rng.randint(0, vocab) for _ in range(input_len)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        sched.add_request(Req(rid=f"{tag}{i}", input_ids=ids, sampling_params=params))


def run_case(llm: LLM, bs: int, input_len: int, output_len: int, ceilings: Ceilings | None) -> dict:
    sched = llm.scheduler
    sched.flush_cache()
    add_static_batch(sched, bs, input_len, output_len, "b")
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    while sched.waiting or sched.chunked:
        sched.step()
    sync()
    ttft = time.perf_counter() - start
    if len(sched.running) != bs:  # a pool too small for the batch runs it in waves: no figure would be this batch's
        raise RuntimeError(f"batch {bs} x {input_len} tokens: {len(sched.running)} requests ran at once after the "
                           f"prefill, not {bs} (KV pool {sched.runner.pool.layout.num_slots} tokens); measure a "
                           "smaller batch or on a GPU with more memory")
    step_times, gpu_busy = [], None
    if torch.cuda.is_available() and sched.has_work() and profiled_steps(output_len) > 0:
        gpu_busy = decode_gpu_busy(sched, steps=profiled_steps(output_len))
    while sched.has_work():
        t = time.perf_counter()
        sched.step()
        step_times.append(time.perf_counter() - t)
    sync()
    total = time.perf_counter() - start
    between_tokens = sorted(step_times[:-1] or step_times)  # the last step ends every request: frees, caches
    tbt = between_tokens[len(between_tokens) // 2] if between_tokens else float("nan")
    row = {"batch_size": bs, "input_len": input_len, "output_len": output_len, "ttft_s": ttft, "tbt_s": tbt,
           "tbt_steps": len(between_tokens),
           "output_tok_per_s": bs * output_len / total, "prefill_tok_per_s": bs * input_len / ttft,
           "decode_gpu_busy": gpu_busy}
    if ceilings is not None:
        cost = ModelCost.of(sched.model_config, itemsize=sched.runner.dtype.itemsize,
                            kv_itemsize=sched.runner.pool.layout.itemsize)
        pairs = bs * input_len * (input_len + 1) // 2
        row["prefill_ideal_s"] = cost.prefill_flops(bs * input_len, pairs) / (ceilings.matmul_tflops * 1e12)
        row["prefill_mfu"] = row["prefill_ideal_s"] / ttft
        mid_ctx = input_len + output_len // 2
        row["decode_ideal_s"] = cost.decode_step_bytes(bs * mid_ctx) / (ceilings.hbm_gbps * 1e9)
        row["tbt_over_ideal"] = tbt / row["decode_ideal_s"]
    return row


def profiled_steps(output_len: int) -> int:
    """Decode steps `decode_gpu_busy` takes of a batch generating output_len tokens: at most half of them, so at least
    as many are left for the time between tokens. (Taking all but two once left a 16-token run one step to time, the
    one ending every request: H200, 2026-11-28, batch 32 x 16k bf16 reported at 32.6 ms, where its steps take 21.3.)"""
    return min(16, (output_len - 2) // 2)


def decode_gpu_busy(sched, steps: int) -> float | None:
    """Fraction of wall time the GPU spends in kernels over `steps` decode steps (torch profiler)."""
    if steps <= 0:
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            sched.step()
        torch.cuda.synchronize()
        wall_us = 1e6 * (time.perf_counter() - start)
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages())
    return kernel_us / wall_us


def build_parser() -> argparse.ArgumentParser:
    parser = engine_bench_parser(__doc__, "write the rows as JSON here (default: printed only)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64], help="batch sizes measured")
    parser.add_argument("--input-lens", type=int, nargs="+", default=[1024], help="prompt lengths measured")
    parser.add_argument("--output-lens", type=int, nargs="+", default=[64], help="output lengths measured")
    return parser


def measure(llm: LLM, args) -> tuple[list[dict], Ceilings | None]:
    """Every (batch size, input, output length) case of args after a warm-up, printed as it is measured."""
    run_case(llm, 1, 64, 4, None)  # warm-up
    ceilings = Ceilings.measure() if torch.cuda.is_available() else None
    rows = []
    for bs, il, ol in itertools.product(args.batch_sizes, args.input_lens, args.output_lens):
        row = run_case(llm, bs, il, ol, ceilings)
        rows.append(row)
        extra = (f"  prefill MFU {100 * row['prefill_mfu']:.1f}%  TBT/ideal {row['tbt_over_ideal']:.2f}x"
                 f"  GPU busy {100 * (row['decode_gpu_busy'] or 0):.0f}%" if ceilings else "")
        print(f"bs={bs:4d} in={il:6d} out={ol:5d}  TTFT {1e3 * row['ttft_s']:8.2f} ms  TBT {1e3 * row['tbt_s']:7.3f} ms"
              f"  {row['output_tok_per_s']:9.1f} tok/s{extra}")
    return rows, ceilings


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args, engine_args = parse_engine_bench_args(parser, argv)
    llm = LLM(args.model_path, **engine_args)
    try:
        rows, ceilings = measure(llm, args)
        quantization = llm.scheduler.model_info["quantization"]
    finally:
        llm.shutdown()
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "date": time.strftime("%Y-%m-%d"), "model": args.model_path,
              "quantization": quantization,
              "ceilings": asdict(ceilings) if ceilings else None, "rows": rows}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "one_batch.json").write_text(json.dumps(result, indent=2))
    return rows


if __name__ == "__main__":
    main()
