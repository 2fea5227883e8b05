"""Host time per decode step: the real scheduler decoding one fixed batch, each step's wall time split into the
model forward (`runner.forward`, or `runner.decode_tokens` for greedy and temperature-only batches, whose sampling
it includes: on a GPU the launch or graph replay, on a CPU the model's compute), the sampler's tensor ops after a
forward (`sampler.sample_tokens`) and everything else (scheduling, batch building, copies, stop checks, outputs):
the Python that keeps a GPU idle when it is longer than the GPU's step.

python -m pdserve.bench.decode_host --model-path DIR [--batch-size 64] [--input-len 128] [--steps 64]
    [--temperature 0.6] [--repeats 3] [--profile FILE] [engine flags as --key value]

On a CPU run it with a tiny model (`python -m pdserve.tools.make_model --preset qwen3-tiny --out DIR`): the
forward is then short and the rest of the step is the host overhead a GPU would wait for.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path
from random import Random

from pdserve import LLM, SamplingParams
from pdserve.bench.cli import engine_bench_parser, parse_engine_bench_args
from pdserve.scheduler.request import Req

WARMUP_STEPS = 8


class SectionTimer:
    """Wraps an instance's method so that the wall time spent inside it accumulates in `seconds`."""

    def __init__(self, owner, name: str):
        self.seconds = 0.0
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(owner, name, timed)

    def take(self) -> float:
        value, self.seconds = self.seconds, 0.0
        return value


def fill_batch(llm: LLM, batch_size: int, input_len: int, steps: int, temperature: float, seed: int) -> None:
    """Admit `batch_size` requests and prefill them all; none finishes within the measured steps."""
    sched = llm.scheduler
    rng = Random(seed)
    vocab = sched.model_config.vocab_size
    for i in range(batch_size):
        ids = [rng.randrange(3, min(10000, vocab)) for _ in range(input_len)]
        params = SamplingParams(temperature=temperature, max_tokens=steps + 2 * WARMUP_STEPS, ignore_eos=True)
        sched.add_request(Req(rid=f"host-{seed}-{i}", input_ids=ids, sampling_params=params))
    while sched.waiting or sched.chunked:
        sched.step()
    if len(sched.running) != batch_size:
        raise RuntimeError(f"only {len(sched.running)} of {batch_size} requests are running; raise --max-total-tokens")


def measure(llm: LLM, args: argparse.Namespace, seed: int, profiler: cProfile.Profile | None) -> dict:
    sched = llm.scheduler
    fill_batch(llm, args.batch_size, args.input_len, args.steps, args.temperature, seed)
    for _ in range(WARMUP_STEPS):
        sched.step()
    forward, sampler = SectionTimer(sched.runner, "forward"), SectionTimer(sched.sampler, "sample_tokens")
    forward_and_sampling = SectionTimer(sched.runner, "decode_tokens")
    steps: list[tuple[float, float, float]] = []
    if profiler is not None:
        profiler.enable()
    for _ in range(args.steps):
        start = time.perf_counter()
        sched.step()
        steps.append((time.perf_counter() - start, forward.take() + forward_and_sampling.take(), sampler.take()))
    if profiler is not None:
        profiler.disable()
    del sched.runner.forward, sched.runner.decode_tokens, sched.sampler.sample_tokens  # the instance wrappers
    while sched.has_work():
        sched.step()
    if not sched.kv_pool_is_fully_free():
        raise RuntimeError("the KV pool is not free after the run")
    return summarize(steps)


def summarize(steps: list[tuple[float, float, float]]) -> dict:
    def median_ms(values) -> float:
        return 1e3 * statistics.median(values)

    return {
        "step_ms": median_ms(s for s, _, _ in steps),
        "forward_ms": median_ms(f for _, f, _ in steps),
        "sampler_ms": median_ms(p for _, _, p in steps),
        "host_ms": median_ms(s - f for s, f, _ in steps),
        "other_ms": median_ms(s - f - p for s, f, p in steps),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = engine_bench_parser(__doc__, "write the result as JSON here")
    parser.add_argument("--batch-size", type=int, default=64, help="requests decoded together")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=64, help="decode steps measured per batch")
    parser.add_argument("--temperature", type=float, default=0.6, help="0 for a greedy batch")
    parser.add_argument("--repeats", type=int, default=3, help="batches measured one after another")
    parser.add_argument("--profile", type=Path, help="write cProfile stats of the measured steps here")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args, engine_args = parse_engine_bench_args(parser, argv)
    llm = LLM(args.model_path, **engine_args)
    profiler = cProfile.Profile() if args.profile else None
    runs = [measure(llm, args, seed, profiler) for seed in range(args.repeats)]
    result = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    result.update(batch_size=args.batch_size, temperature=args.temperature, runs=runs,
                  device=str(llm.scheduler.device), overlap=llm.scheduler.overlap)
    print(f"bs={args.batch_size} T={args.temperature}: step {result['step_ms']:.3f} ms = forward "
          f"{result['forward_ms']:.3f} + host {result['host_ms']:.3f} (sampler {result['sampler_ms']:.3f}, "
          f"other {result['other_ms']:.3f}) ms, median of {args.repeats} x {args.steps} steps")
    if profiler is not None:
        profiler.dump_stats(args.profile)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
