"""Warm-up before ready: every kernel variant serving will use runs once, so Triton compiles it (or loads it from
its on-disk cache) before the first real request instead of during it.

Triton compiles a variant per specialization of a kernel's integer arguments (== 1, divisible by 16) and of its
pointers' 16-byte alignment. The batch tensors start aligned whatever the batch (`forward_batch.packed_to_device`)
and the kernels' length and row-offset arguments are not specialized (`do_not_specialize` in `pdserve/kernels/`),
so what varies with traffic is the paths taken; the plan reaches them with lengths in every residue class anyway
(== 1, odd, = 0 and != 0 mod 16):
- prompts alone: short ones, the SDPA path of long fresh prompts (1024 and an odd 1031), a prompt longer than a
  chunk (its second chunk attends over its prefix);
- batches of 2, 3 and 4 prompts of mixed lengths in one extend, each then decoding as a batch of its size;
- with a prefix cache, extends of 1, 15, 16 and 33 new tokens over a cached prompt of whole pages, alone and all
  four in one extend;
- the samplers (greedy; temperature with top-k, top-p and min-p; penalties, which sample on the host side);
- with a grammar backend, batches of 1, 3 and 16 requests under a regex (greedy and temperature rows): xgrammar's
  bitmask kernel specializes on its row count (== 1, a multiple of 16, other), the sampler on float32 logits; and
  a JSON schema of every common kind compiled, so a user's first schema finds their rules' token masks built (a
  length-bounded string's are per bound: its own, docs/benchmarks.md "Structured output").
Decode batch sizes up to the largest captured one also run in CUDA graphs (`engine/cuda_graph.py`, at start).
On the CPU, where torch compiles nothing, one short prompt alone, one batch and one constrained request run the
same code paths. Requests go through the scheduler as real ones do; afterwards the cache, the sampler's seed, the
prefill-rate meter and the grammar counters and compile cache are as they were (the tokenizer's grammar tables stay
built), so a warmed server answers exactly as an unwarmed one.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace

from pdserve.constrained.compiler import GrammarError, GrammarSpec, import_xgrammar
from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.request import Req
from pdserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

ALONE_LENGTHS = (1, 17, 32, 250, 256, 1024, 1031, 4096)  # 1024: the SDPA backend's first long-prompt length
MIXED_BATCHES = ((1, 17), (32, 33, 250), (16, 17, 250, 1031))
PREFIX_PAGES = 4  # the cached prompt the prefix-hit extends run over
PREFIX_EXTENSIONS = (33, 16, 15, 1)
WARMUP_TIMEOUT_S = 1800.0  # first compiles of every variant on a cold cache
MAX_NEW_TOKENS = 3  # the first token from the extend, then decode steps
SAMPLINGS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True),
    "top_k_top_p_min_p": SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05,
                                        max_tokens=MAX_NEW_TOKENS, ignore_eos=True),
    "penalties": SamplingParams(temperature=0.7, frequency_penalty=0.5, presence_penalty=0.2,
                                repetition_penalty=1.1, max_tokens=MAX_NEW_TOKENS, ignore_eos=True),
}
CONSTRAINED_BATCHES = (1, 3, 16)  # the bitmask kernel's row counts: == 1, other, a multiple of 16
CONSTRAINED_PROMPT = 17
GRAMMAR = "[0-9]{128}"  # no MAX_NEW_TOKENS tokens hold 128 digits: every request decodes to its length
# every common kind of JSON value; a string of at most WARM_STRING_BOUND characters leaves the token masks of every
# shorter bound built too (`constrained.json_schema.strict_json_grammar`): about 1 s of the warm-up on 8 compile threads
WARM_STRING_BOUND = 128
COMMON_KINDS = ({"type": "string", "maxLength": WARM_STRING_BOUND}, {"type": "string"}, {"type": "integer"},
                {"type": "number"}, {"type": "boolean"}, {"type": "null"}, {"enum": ["a", "b"]}, {"type": "array", "items": {"type": "string"}},
                {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
                {"type": "string", "format": "date"}, {"anyOf": [{"type": "integer"}, {"type": "null"}]})
WARM_GRAMMARS = (GrammarSpec("regex", GRAMMAR), GrammarSpec("json_schema", json.dumps(
    {"type": "object", "properties": {f"p{i}": kind for i, kind in enumerate(COMMON_KINDS)},
     "required": [f"p{i}" for i in range(len(COMMON_KINDS))], "additionalProperties": False})))
CONSTRAINED_SAMPLINGS = (  # both sampled on the device after the mask, so these batches decode overlapped
    SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, regex=GRAMMAR),
    SamplingParams(temperature=0.8, max_tokens=MAX_NEW_TOKENS, regex=GRAMMAR),
)


@dataclass(frozen=True, slots=True)
class WarmupPlan:
    alone: tuple[int, ...]  # prompt lengths run one at a time
    batches: tuple[tuple[int, ...], ...]  # prompt lengths run together, one batch after the other
    prefix: int = 0  # tokens of the cached prompt the prefix-hit extends run over (0: none)
    extensions: tuple[int, ...] = ()  # new tokens of each prefix-hit extend: one at a time, then all together
    constrained: tuple[int, ...] = ()  # sizes of the batches of requests under GRAMMAR, one after the other


CPU_PLAN = WarmupPlan(alone=(32,), batches=((32,) * len(SAMPLINGS),))  # every sampling in one batched decode
CPU_CONSTRAINED = (1,)


@dataclass(frozen=True, slots=True)
class WarmupReport:
    prompt_lengths: tuple[int, ...]  # the prompts run alone
    samplings: tuple[str, ...]
    extend_tokens: tuple[int, ...]  # tokens of each extend forward that ran
    prefix_hit_extends: tuple[int, ...]  # new tokens of each extended request whose KV started past a cached prefix
    decode_batch_sizes: tuple[int, ...]  # batch size of each decode forward that ran
    constrained_batches: tuple[int, ...]  # sizes of the batches under a grammar
    masked_rows: int  # sampled rows the grammar's bitmask masked
    seconds: float

    def describe(self) -> dict:
        return {"prompt_lengths": list(self.prompt_lengths), "samplings": list(self.samplings),
                "extend_tokens": list(self.extend_tokens), "prefix_hit_extends": list(self.prefix_hit_extends),
                "decode_batch_sizes": list(self.decode_batch_sizes),
                "constrained_batches": list(self.constrained_batches), "masked_rows": self.masked_rows,
                "seconds": round(self.seconds, 3)}


def gpu_plan(room: int, chunk: int, page_size: int, prefix_cache: bool, grammar_rows: int = 0) -> WarmupPlan:
    """The plan on CUDA for prompts of at most `room` tokens and prefill chunks of `chunk`; `grammar_rows`: the most
    requests a constrained batch may have (0: no grammar backend)."""
    def fit(lengths) -> tuple[int, ...]:
        return tuple(min(n, room) for n in lengths)

    alone = tuple(sorted({n for n in fit((*ALONE_LENGTHS, chunk + 32)) if n > 0}))
    batches = tuple(fit(lengths) for lengths in MIXED_BATCHES)
    constrained = tuple(sorted({min(n, grammar_rows) for n in CONSTRAINED_BATCHES})) if grammar_rows else ()
    prefix = PREFIX_PAGES * page_size
    if not prefix_cache or prefix + max(PREFIX_EXTENSIONS) > room:
        return WarmupPlan(alone, batches, constrained=constrained)
    return WarmupPlan(alone, batches, prefix, PREFIX_EXTENSIONS, constrained)


def warmup_plan(sched: Scheduler) -> WarmupPlan:
    grammar_rows = sched.args.max_running_requests if grammar_backend_active(sched.args.grammar_backend) else 0
    if sched.device.type != "cuda":
        return replace(CPU_PLAN, constrained=CPU_CONSTRAINED if grammar_rows else ())
    room = min(sched.context_len, sched.allocator.capacity * sched.page_size // 2) - MAX_NEW_TOKENS
    chunk = min(sched.args.chunked_prefill_size, sched.args.max_prefill_tokens)
    return gpu_plan(room, chunk, sched.page_size, sched.args.keeps_prefix_cache, grammar_rows)


def grammar_backend_active(backend: str) -> bool:
    """Grammar requests would be compiled here: `--grammar-backend` is not none and xgrammar imports."""
    if backend == "none":
        return False
    try:
        import_xgrammar()
    except GrammarError:
        return False
    return True


class ForwardLog:
    """What the warm-up's forwards ran, seen through the runner's forward observers."""

    def __init__(self) -> None:
        self.extend_tokens: list[int] = []
        self.prefix_hit_extends: list[int] = []
        self.decode_sizes: list[int] = []

    def observe(self, batch: ForwardBatch) -> None:
        if batch.mode != ForwardMode.EXTEND:
            self.decode_sizes.append(batch.batch_size)
            return
        self.extend_tokens.append(sum(batch.extend_lens_cpu))
        self.prefix_hit_extends += [n for p, n in zip(batch.prefix_lens_cpu, batch.extend_lens_cpu) if p]


def warm_up(sched: Scheduler, plan: WarmupPlan | None = None) -> WarmupReport:
    """Runs the warm-up requests to completion; raises TimeoutError if they do not finish in time."""
    started = time.perf_counter()
    plan = plan or warmup_plan(sched)
    log = ForwardLog()
    prompts = WarmupPrompts(sched)
    sched.runner.forward_observers.append(log.observe)
    try:
        _run_plan(sched, plan, prompts)
    finally:
        sched.runner.forward_observers.remove(log.observe)
    _measure_step_costs(sched, plan, prompts)
    masked_rows = sched.num_masked_rows
    sched.sampler.reseed(sched.args.random_seed)
    sched.reset_stats()
    report = WarmupReport(plan.alone, tuple(SAMPLINGS), tuple(log.extend_tokens), tuple(log.prefix_hit_extends),
                          tuple(log.decode_sizes), plan.constrained, masked_rows, time.perf_counter() - started)
    logger.info("warm-up done in %.1f s: prompts of %s tokens alone, batches of %s, extends of %s tokens over a "
                "cached %d-token prefix, samplings %s, constrained batches of %s (%d masked rows); %d extend and %d "
                "decode forwards; seed, caches and counters reset: answers as an unwarmed server's", report.seconds,
                list(plan.alone), [list(b) for b in plan.batches], list(plan.extensions), plan.prefix,
                ", ".join(SAMPLINGS), list(plan.constrained), masked_rows, len(log.extend_tokens),
                len(log.decode_sizes))
    return report


def _run_plan(sched: Scheduler, plan: WarmupPlan, prompts: WarmupPrompts) -> None:
    """Each phase starts on an empty prefix cache, so every prompt computes all of its tokens but the prefix-hit
    extends' cached prefix."""
    _run_fresh(sched, plan, prompts)
    if plan.prefix:
        base = prompts.fresh(plan.prefix)
        _run(sched, [base], flush=False)
        for n in plan.extensions:
            _run(sched, [prompts.extending(base, n)], flush=False)
        _run(sched, [prompts.extending(base, n) for n in plan.extensions])
    for spec in WARM_GRAMMARS if plan.constrained else ():
        sched.grammar_queue.compile_untimed(spec)
    for size in plan.constrained:
        _run(sched, [prompts.constrained(CONSTRAINED_PROMPT) for _ in range(size)])


def _run_fresh(sched: Scheduler, plan: WarmupPlan, prompts: WarmupPrompts) -> None:
    for length in plan.alone:
        _run(sched, [prompts.fresh(length)])
    for lengths in plan.batches:
        _run(sched, [prompts.fresh(n) for n in lengths])


def _measure_step_costs(sched: Scheduler, plan: WarmupPlan, prompts: WarmupPrompts) -> None:
    """The step costs the TPOT budget and `/load` start from, measured over the plan's fresh prompts again now that
    their kernels are compiled (a compile is no step's cost)."""
    costs = sched.tpot_budget.costs
    costs.forget()
    _run_fresh(sched, plan, prompts)
    fixed, per_token = costs.extend_line()
    logger.info("step costs: decode step %.2f ms, extend %.2f ms + %.2f us per token (TPOT budget %g ms)",
                costs.decode_s * 1e3, fixed * 1e3, per_token * 1e6, sched.args.decode_tpot_budget_ms)


class WarmupPrompts:
    """Warm-up requests whose prompts share no page unless asked to; the samplings taken in turn."""

    def __init__(self, sched: Scheduler):
        self.bootstrap = sched.role.warmup_bootstrap
        self.vocab = sched.model_config.vocab_size
        self.count = 0

    def fresh(self, length: int) -> Req:
        return self._request(self._ids(length))

    def constrained(self, length: int) -> Req:
        """A fresh prompt under GRAMMAR, the constrained samplings taken in turn."""
        return self._request(self._ids(length), CONSTRAINED_SAMPLINGS[self.count % len(CONSTRAINED_SAMPLINGS)])

    def extending(self, base: Req, new_tokens: int) -> Req:
        """`base`'s prompt followed by `new_tokens` tokens no other prompt has."""
        return self._request(base.input_ids + self._ids(new_tokens))

    def _ids(self, length: int) -> list[int]:
        return [(self.count * 7 + i * 7919 + 17) % (self.vocab - 1) + 1 for i in range(length)]

    def _request(self, ids: list[int], params: SamplingParams | None = None) -> Req:
        names = list(SAMPLINGS)
        params = SamplingParams.from_dict((params or SAMPLINGS[names[self.count % len(names)]]).to_dict())
        req = Req.of(f"warmup-{self.count}", ids, params, **self.bootstrap)
        self.count += 1
        return req


def _run(sched: Scheduler, reqs: list[Req], flush: bool = True) -> None:
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
    if flush:
        sched.flush_cache()  # the next run's prompts find nothing cached
