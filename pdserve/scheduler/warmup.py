"""Warm-up before ready: every kernel variant serving will use runs once, so Triton compiles it (or loads it from
its on-disk cache) before the first real request instead of during it.

Decode batch sizes are covered where CUDA graphs are captured (`engine/cuda_graph.py`, at start). This pass adds
what the graphs leave out: extend batches for a few prompt-length buckets (short prompts; the SDPA path of long
fresh prompts; a prompt longer than a chunk, whose second chunk attends over its prefix), an eager batched decode,
and the samplers (greedy; temperature with top-k, top-p and min-p; penalties, which sample on the host side).
On the CPU, where torch compiles nothing, one short bucket runs the same code paths.
Requests go through the scheduler as real ones do; afterwards the cache, the sampler's seed and the prefill-rate
meter are as they were, so a warmed server answers exactly as an unwarmed one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.request import Req
from pdserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

PROMPT_BUCKETS = (32, 256, 1024, 4096)  # 1024: the SDPA backend's first long-prompt length
CPU_PROMPT_BUCKETS = PROMPT_BUCKETS[:1]  # torch's CPU kernels compile nothing: one pass over the code paths
WARMUP_TIMEOUT_S = 1800.0  # first compiles of every variant on a cold cache
MAX_NEW_TOKENS = 3  # the first token from the extend, then decode steps
SAMPLINGS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True),
    "top_k_top_p_min_p": SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05,
                                        max_tokens=MAX_NEW_TOKENS, ignore_eos=True),
    "penalties": SamplingParams(temperature=0.7, frequency_penalty=0.5, presence_penalty=0.2,
                                repetition_penalty=1.1, max_tokens=MAX_NEW_TOKENS, ignore_eos=True),
}


@dataclass(frozen=True, slots=True)
class WarmupReport:
    prompt_lengths: tuple[int, ...]  # the prompts run, one at a time, then all at once
    samplings: tuple[str, ...]
    extend_tokens: tuple[int, ...]  # tokens of each extend forward that ran
    decode_batch_sizes: tuple[int, ...]  # batch size of each decode forward that ran
    seconds: float

    def describe(self) -> dict:
        return {"prompt_lengths": list(self.prompt_lengths), "samplings": list(self.samplings),
                "extend_tokens": list(self.extend_tokens), "decode_batch_sizes": list(self.decode_batch_sizes),
                "seconds": round(self.seconds, 3)}


def prompt_lengths(sched: Scheduler) -> list[int]:
    """The buckets that fit the context and the KV pool, plus (on CUDA) one prompt a bucket longer than a prefill
    chunk."""
    if sched.device.type != "cuda":
        return list(CPU_PROMPT_BUCKETS)
    room = min(sched.context_len, sched.allocator.capacity * sched.page_size // 2) - MAX_NEW_TOKENS
    chunk = min(sched.args.chunked_prefill_size, sched.args.max_prefill_tokens)
    lengths = {min(n, room) for n in (*PROMPT_BUCKETS, chunk + PROMPT_BUCKETS[0])}
    return sorted(n for n in lengths if n > 0)


def warm_up(sched: Scheduler) -> WarmupReport:
    """Runs the warm-up requests to completion; raises TimeoutError if they do not finish in time."""
    started = time.perf_counter()
    lengths = prompt_lengths(sched)
    vocab = sched.model_config.vocab_size
    extend_tokens: list[int] = []
    decode_sizes: list[int] = []

    def observe(batch: ForwardBatch) -> None:
        if batch.mode == ForwardMode.EXTEND:
            extend_tokens.append(sum(batch.extend_lens_cpu))
        else:
            decode_sizes.append(batch.batch_size)

    sched.runner.forward_observers.append(observe)
    try:
        names = list(SAMPLINGS)
        for i, n in enumerate(lengths):  # alone, then all at once (each sampling in a batched decode)
            _run(sched, [_request(sched, i, n, names[i % len(names)], vocab)])
        _run(sched, [_request(sched, len(lengths) + i, lengths[i % len(lengths)], name, vocab)
                     for i, name in enumerate(names)])
    finally:
        sched.runner.forward_observers.remove(observe)
    sched.sampler.reseed(sched.args.random_seed)
    sched.reset_stats()
    report = WarmupReport(tuple(lengths), tuple(names), tuple(extend_tokens), tuple(decode_sizes),
                          time.perf_counter() - started)
    logger.info("warm-up done in %.1f s: prompts of %s tokens, samplings %s, %d extend and %d decode forwards",
                report.seconds, lengths, ", ".join(names), len(extend_tokens), len(decode_sizes))
    return report


def _request(sched: Scheduler, index: int, length: int, sampling: str, vocab: int) -> Req:
    """A prompt no other warm-up prompt shares a page with, so every one computes all of its tokens."""
    ids = [(index * 7 + i * 7919 + 17) % (vocab - 1) + 1 for i in range(length)]
    params = SamplingParams.from_dict(SAMPLINGS[sampling].to_dict())
    return Req.of(f"warmup-{index}", ids, params, **sched.role.warmup_bootstrap)


def _run(sched: Scheduler, reqs: list[Req]) -> None:
    for req in reqs:
        sched.add_request(req)
    deadline = time.monotonic() + WARMUP_TIMEOUT_S
    while not all(r.finished for r in reqs) or sched.has_work():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the warm-up did not finish in {WARMUP_TIMEOUT_S:g} s")
        sched.step()
    failed = [f"{r.rid}: {r.finish_reason.message}" for r in reqs if r.finish_reason.type == "abort"]
    if failed:
        raise RuntimeError(f"warm-up requests failed: {'; '.join(failed)}")
    sched.flush_cache()  # the next run's prompts find nothing cached
