"""Accuracy of a configuration (an FP8 KV cache, quantized weights) against a baseline on the same prompts: the
prompt logprobs at every position (`logprob_start_len` 0) and the greedy output.

    python -m pdserve.bench.accuracy --model-path DIR --num-prompts 200 [--input-len 512] [--output-len 64] \\
        --candidate="--kv-cache-dtype fp8_e4m3 --kv-cache-scales scales.json" [--out DIR] [engine flags of both]

The baseline engine (the engine flags) runs every prompt, is shut down, then the candidate (the engine flags and
--candidate's) runs them. Reported: the mean and max absolute difference of the prompt logprobs over every scored
position; greedy agreement: the share of output tokens equal to the baseline's before each prompt's first
divergence, the share of prompts whose outputs are identical, and the first divergence (prompt, output position).
Prompts are random token ids (seeded), or the lines of --prompts-file.
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from random import Random

from pdserve import LLM, SamplingParams
from pdserve.bench.cli import engine_bench_parser, parse_engine_bench_args


@dataclass(frozen=True, slots=True)
class RunResult:
    prompt_logprobs: list[list[float]]  # per prompt, the logprob of each prompt token after the first
    outputs: list[list[int]]  # greedy output ids


@dataclass(frozen=True, slots=True)
class Agreement:
    num_prompts: int
    scored_positions: int
    logprob_mean_abs_diff: float
    logprob_max_abs_diff: float
    greedy_token_agreement: float  # output tokens equal to the baseline's before each prompt's first divergence
    identical_outputs: float  # share of prompts whose whole output equals the baseline's
    first_divergence: list[int] | None  # [prompt, output position] of the first differing greedy token; None: none


def random_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = Random(seed)
    return [[rng.randint(0, min(10000, vocab - 1)) for _ in range(length)] for _ in range(num)]


def run(llm: LLM, prompts: list, output_len: int) -> RunResult:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, prompt_logprobs=0,
                            logprob_start_len=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return RunResult([[lp for lp in o.prompt_logprobs if lp is not None] for o in outs], [o.token_ids for o in outs])


def compare(baseline: RunResult, candidate: RunResult) -> Agreement:
    diffs = [abs(a - b) for base, cand in zip(baseline.prompt_logprobs, candidate.prompt_logprobs)
             for a, b in zip(base, cand)]
    agreed = total = identical = 0
    first = None
    for index, (base, cand) in enumerate(zip(baseline.outputs, candidate.outputs)):
        prefix = next((i for i, (a, b) in enumerate(zip(base, cand)) if a != b), min(len(base), len(cand)))
        agreed, total, identical = agreed + prefix, total + len(base), identical + (base == cand)
        if first is None and base != cand:
            first = [index, prefix]
    num = len(baseline.outputs)
    return Agreement(num, len(diffs), sum(diffs) / max(len(diffs), 1), max(diffs, default=0.0),
                     agreed / max(total, 1), identical / max(num, 1), first)


def build_parser() -> argparse.ArgumentParser:
    parser = engine_bench_parser(__doc__, "write the result as JSON here (default: printed only)")
    parser.add_argument("--candidate", required=True, help="engine flags of the candidate, in one quoted string (--candidate=\"...\")")
    parser.add_argument("--num-prompts", type=int, default=200, help="prompts compared")
    parser.add_argument("--input-len", type=int, default=512, help="random prompts: tokens each")
    parser.add_argument("--output-len", type=int, default=64, help="greedy tokens generated per prompt")
    parser.add_argument("--prompts-file", type=Path, help="one prompt per line instead of random token ids")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random prompts")
    return parser


def main(argv: list[str] | None = None) -> Agreement:
    parser = build_parser()
    args, engine_args = parse_engine_bench_args(parser, argv)
    _, candidate_args = parse_engine_bench_args(build_parser(), ["--model-path", args.model_path, "--candidate", "",
                                                                 *shlex.split(args.candidate)])
    results = []
    for extra in ({}, candidate_args):
        llm = LLM(args.model_path, **{**engine_args, **extra})
        if args.prompts_file:
            prompts = [line for line in args.prompts_file.read_text().splitlines() if line.strip()][: args.num_prompts]
        else:
            prompts = random_prompts(args.num_prompts, args.input_len, llm.scheduler.model_config.vocab_size,
                                     args.seed)
        results.append(run(llm, prompts, args.output_len))
        llm.shutdown()
    agreement = compare(*results)
    print(f"{agreement.num_prompts} prompts, {agreement.scored_positions} prompt positions: logprob |diff| mean "
          f"{agreement.logprob_mean_abs_diff:.4g}, max {agreement.logprob_max_abs_diff:.4g}; greedy tokens agreeing "
          f"{100 * agreement.greedy_token_agreement:.1f}%, identical outputs {100 * agreement.identical_outputs:.1f}%; "
          f"first divergence [prompt, position] {agreement.first_divergence}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"date": time.strftime("%Y-%m-%d"), "model": args.model_path, "baseline": engine_args,
                  "candidate": {**engine_args, **candidate_args}, **asdict(agreement)}
        (args.out / "accuracy.json").write_text(json.dumps(result, indent=2))
    return agreement


if __name__ == "__main__":
    main()
