"""Continuous batching over a paged KV pool: admission, chunked prefill, decode, retraction, abort.

One `step()` runs at most one forward pass: an extend batch (new prompts and the continuing chunked
prompt, prefill first) when there is one, else a decode batch of every running request. The scheduler is given
its model runner and its role (`role.py`: colocated by default, or a PD role); every `self.role.` call below is
a point where the role acts, and the methods under "for the roles" are all a role may call back.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque

import torch

from pdserve.config import ServerArgs
from pdserve.constrained.compiler import GrammarError
from pdserve.constrained.matcher import RequestGrammar, TokenBitmask
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampler import SampleResult, SamplingRow, SamplingTensors, prompt_logprobs
from pdserve.forward_batch import ForwardBatch
from pdserve.mem_cache.factory import create_prefix_cache
from pdserve.mem_cache.kv_pool import PageAllocator
from pdserve.messages import TokenOut
from pdserve.scheduler.extend_batch import ExtendBatch, ExtendItem
from pdserve.scheduler.grammar_queue import GrammarQueue
from pdserve.scheduler.decode_input_batch import DecodeInputBatch
from pdserve.scheduler.device_stamps import DeviceStamps
from pdserve.scheduler.load import PrefillRateMeter
from pdserve.scheduler.overlap import HostCopier, InflightDecode, decode_inputs
from pdserve.scheduler.request import FinishReason, Req, ReqStatus
from pdserve.scheduler.role import Role
from pdserve.scheduler.step_timer import DECODE, EXTEND, StepTimer
from pdserve.scheduler.stop import StopChecker
from pdserve.scheduler.tpot_budget import TpotBudget
from pdserve.tokenizer import load_tokenizer
from pdserve.timeline import (ADMITTED, FIRST_TOKEN_EMITTED, FIRST_TOKEN_SAMPLED, OUTPUT_TOKEN, PREFILL_CHUNK_END,
                              PREFILL_CHUNK_START, QUEUED)

logger = logging.getLogger(__name__)


class Scheduler:
    """`runner`: a `ModelRunner`, or anything with its `forward`, `decode_tokens`, `sampler`, `pool`, `device`,
    `context_len` and `model_config` (the scheduler tests run a fake one)."""

    def __init__(self, args: ServerArgs, runner: ModelRunner, role: Role | None = None, tokenizer=None):
        self.args = args
        self.runner = runner
        self.model_config = runner.model_config
        self.device = runner.device
        self.page_size = args.page_size
        self.context_len = runner.context_len
        self.allocator = PageAllocator(runner.pool.layout.num_pages)
        self.radix = create_prefix_cache(args, self.allocator, runner.pool)  # a NullPrefixCache when disabled
        self.sampler = runner.sampler
        self.stop_checker = StopChecker(args, self.model_config, tokenizer)
        self.grammar_queue = GrammarQueue(args, self.model_config,
                                          lambda: tokenizer if tokenizer is not None else load_tokenizer(args))
        self.decode_reserve_ratio = min(1.0, 0.7 * args.schedule_conservativeness)
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None
        self.running: list[Req] = []
        self.input_batch: DecodeInputBatch | None = None  # device state of the last decode batch
        self.reqs: dict[str, Req] = {}
        self._changed: dict[str, Req] = {}
        self.num_retracted = 0
        self.num_masked_rows = 0  # sampled rows a grammar masked
        self.num_masked_steps = 0  # sampling steps that masked any row (rows per step: the ratio of the two)
        self.overlap = not args.disable_overlap_schedule
        self.inflight: InflightDecode | None = None
        self.host_copier = HostCopier(args.max_running_requests)
        self.token_bitmask = TokenBitmask(args.max_running_requests)
        self.prefill_meter = PrefillRateMeter()
        self.device_stamps = DeviceStamps(self.device)  # a forward's stages as the device ran it
        self.tpot_budget = TpotBudget.from_args(args, self.page_size, lambda: (r.rid for r in self.running))
        self.step_timer = StepTimer(self.device)  # the tests give theirs a clock their forwards advance
        self.role = role or Role()
        self.role.bind(self)

    # ---- public API -------------------------------------------------------------------------------------------

    @property
    def model_info(self) -> dict:
        cfg = self.model_config
        return {
            "model_path": self.args.model_path,
            "architecture": cfg.architecture,
            "max_context_len": self.context_len,
            "vocab_size": cfg.vocab_size,
            "eos_token_ids": list(cfg.eos_token_ids),
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "quantization": cfg.quantization.describe() if cfg.quantization is not None else None,
            "device": str(self.device),
            "page_size": self.page_size,
            "max_total_tokens": self.allocator.capacity * self.page_size,
            "hicache_host_total_tokens": self.radix.host_capacity_pages * self.page_size,
            "attention_backend": self.runner.backend_name,
            "cuda_graphs": self.runner.graph_runner is not None,
            "disaggregation_mode": self.args.disaggregation_mode,
            "tp_size": self.args.tp_size,
            **self.role.server_info(),
        }

    def add_request(self, req: Req) -> None:
        """Validate req and hand it to the role; a request with a grammar first waits for its compile."""
        self.validate(req)
        if req.sampling_params.grammar is not None:
            try:
                self.grammar_queue.submit(req)
            except GrammarError as exc:  # no grammar can be compiled here: a 400
                self.role.refuse(req, str(exc))
                raise
        self.reqs[req.rid] = req
        self.radix.prefetch(req.rid, req.input_ids)
        if req.sampling_params.grammar is None:
            self.role.accept(req)

    def _accept_compiled_grammars(self) -> None:
        """Requests whose grammar compiled go on to their role; those whose compile failed end with a 400."""
        for outcome in self.grammar_queue.poll():
            if outcome.error is not None:
                self.role.refuse(outcome.req, outcome.error)
                self.finish(outcome.req, FinishReason("abort", message=outcome.error, status_code=400))
                continue
            outcome.req.grammar = outcome.grammar
            self.role.accept(outcome.req)

    def validate(self, req: Req) -> None:
        """What only the scheduler knows; the prompt itself was checked where it entered (`check_prompt`)."""
        n = len(req.input_ids)
        if req.rid in self.reqs:
            raise ValueError(f"request id {req.rid!r} is already in flight")
        if math.ceil((n + 1) / self.page_size) > self.allocator.capacity:
            raise ValueError(
                f"the prompt has {n} tokens but the KV cache holds only {self.allocator.capacity * self.page_size}"
            )
        self.role.validate(req)

    def abort_request(self, rid: str, message: str = "aborted by request") -> None:
        req = self.reqs.get(rid)
        if req is None or self.role.abort(req, message) or req.finished:
            return
        self.end(req, FinishReason("abort", message=message))

    def step(self) -> list[TokenOut]:
        self._accept_compiled_grammars()
        if not self.role.prepare_step():
            return self._collect_outputs()
        self._settle_step_timings()
        items = self.role.plan_extend()
        if items:
            self._finish_inflight()
            self._timed_extend(items)
        elif self.running:
            self._timed_decode()
        else:
            self._finish_inflight()
            self.step_timer.idle()
        return self._collect_outputs()

    def _timed_extend(self, items: list[ExtendItem]) -> None:
        tokens = sum(i.end - i.start for i in items)
        booked = self.tpot_budget.extend_started(tokens, decoding=bool(self.running))
        self.step_timer.begin(EXTEND)
        self._run_extend(items)
        self.step_timer.end(EXTEND, tokens, booked)

    def _timed_decode(self) -> None:
        size, booked = len(self.running), self.tpot_budget.decode_started()
        self.step_timer.begin(DECODE)
        self._run_decode()
        self.step_timer.end(DECODE, size, booked)

    def _settle_step_timings(self) -> None:
        """Steps whose device work has finished tell their measured time to the TPOT budget and the rate meter."""
        for timing in self.step_timer.completed():
            if timing.kind == DECODE:
                self.tpot_budget.decode_measured(timing.seconds, timing.booked_s)
                continue
            self.tpot_budget.extend_measured(timing.size, timing.seconds, timing.booked_s)
            self.prefill_meter.record(timing.size, timing.seconds)

    def has_work(self) -> bool:
        """Any request not finished yet (the PD roles add those waiting for a message from their peer, the grammar
        queue those waiting for a compile)."""
        return self.can_step() or self.role.has_work() or bool(self.grammar_queue.pending)

    def can_step(self) -> bool:
        """The next step makes progress without waiting for a request, a wake-up fd or a deadline."""
        return bool(self.waiting or self.running or self.chunked or self._changed or self.inflight) \
            or self.role.can_step()

    def idle_poll_ms(self) -> int:
        return self.role.idle_poll_ms()

    def wakeup_fds(self) -> list[int]:
        return [*self.role.wakeup_fds(), self.grammar_queue.wake_fd]

    def flush_cache(self) -> bool:
        if self.waiting or self.running or self.chunked or self.inflight:
            return False
        self.radix.reset()
        return True

    def kv_pool_is_fully_free(self) -> bool:
        """Every page is free or held by the prefix cache alone (no request, handoff, write or quarantine still
        holds one)."""
        if self.role.holds_pages():
            return False
        free = self.allocator.num_free + self.radix.evictable_pages()
        return free == self.allocator.capacity and not self._pages_in_use_by_reqs()

    def stats(self) -> dict:
        used = self.allocator.capacity - self.allocator.num_free
        return {
            "num_running": len(self.running) + (1 if self.chunked else 0),
            "num_waiting": len(self.waiting),
            "kv_used_tokens": used * self.page_size,
            "kv_total_tokens": self.allocator.capacity * self.page_size,
            "kv_cached_tokens": self.radix.num_pages * self.page_size,
            "prefix_query_tokens": self.radix.query_tokens,
            "prefix_hit_tokens": self.radix.hit_tokens,
            "num_retracted": self.num_retracted,
            **self.radix.tier_stats(),
            **self.load_report(),
            "tpot_budget": self.tpot_budget.stats(),
            **self.grammar_queue.stats(),
            "grammar_masked_rows": self.num_masked_rows,
            "grammar_masked_steps": self.num_masked_steps,
            **self.role.stats(),
        }

    def reset_stats(self) -> None:
        """Counters and measurements start over (after the warm-up)."""
        self.num_retracted = 0
        self.num_masked_rows = self.num_masked_steps = 0
        self.grammar_queue.reset_stats()
        self.prefill_meter = PrefillRateMeter()
        self.tpot_budget.reset()
        self.radix.reset_hit_counts()
        self.role.reset_stats()

    def load_report(self) -> dict:
        """What the router weighs to place a prompt (`/load`): the prefill queued here, the full-speed prefill rate
        measured, the rate a new prompt gets now (within the TPOT budget while requests decode), the decode pace, and
        the share of the KV pool that requests hold (pages the prefix cache could evict count as free)."""
        held = max(0, self.allocator.capacity - self.available_pages())
        return {
            "queued_prefill_tokens": self.queued_prefill_tokens(),
            "prefill_tokens_per_s": round(self.prefill_meter.tokens_per_s, 1),
            "local_prefill_tokens_per_s": round(self._new_prompt_rate(), 1),
            "decode_step_ms": round(self.tpot_budget.costs.decode_s * 1e3, 3),
            "num_running_reqs": len(self.running),
            "kv_usage": round(held / self.allocator.capacity, 4),
            "tpot_budget_ms": self.args.decode_tpot_budget_ms,
            **self.tpot_budget.load_report(),
        }

    def _new_prompt_rate(self) -> float:
        """Prompt tokens per second a new prompt would be prefilled at now; 0.0 when the KV pool has no room for a
        minimum chunk next to the running requests' growth (or the role takes no such prompts)."""
        if self.available_pages() - self._running_reserve() < math.ceil(self.tpot_budget.min_chunk / self.page_size):
            return 0.0
        return self.role.offered_prefill_rate(self.tpot_budget.prefill_rate(decoding=bool(self.running)))

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens admitted or waiting that no forward pass has computed yet."""
        queued = sum(len(r.all_ids) - r.num_cached_tokens for r in self.waiting)
        if self.chunked is not None:
            queued += len(self.chunked.all_ids) - self.chunked.num_cached_tokens
        return queued + self.role.queued_prefill_tokens()

    def close(self) -> None:
        self.grammar_queue.close()
        self.device_stamps.close()
        self.role.close()

    # ---- for the roles ----------------------------------------------------------------------------------------

    def enqueue(self, req: Req) -> None:
        """req waits for admission and prefill (behind every request queued before it)."""
        req.stage_marks.mark(QUEUED)
        self.waiting.append(req)

    def start_decoding(self, req: Req) -> None:
        """req's prompt KV and first token are in place: it joins the decode batch."""
        req.status = ReqStatus.RUNNING
        self.running.append(req)

    def cache_kv(self, req: Req) -> None:
        """Offer req's computed KV to the prefix cache (which takes its own references)."""
        self.radix.insert(req.all_ids[: req.num_cached_tokens], req.pages)

    def add_token(self, req: Req, token: int, logprob: float | None = None, top_logprobs: list | None = None) -> None:
        """Append req's next token (and its logprobs when req asked for them); finish req if it stops there."""
        if self._refused_by_grammar(req, token):
            return
        req.output_ids.append(token)
        req.stage_marks.mark(OUTPUT_TOKEN)
        if logprob is not None and req.return_logprob:
            req.output_logprobs.append(logprob)
            req.output_top_logprobs.append(top_logprobs)
        self._changed[req.rid] = req
        reason = self.role.check_stop(req)
        if reason is not None:
            self.finish(req, reason)

    def _refused_by_grammar(self, req: Req, token: int) -> bool:
        """req's grammar takes `token`, or req ends with a 500 and this is True."""
        if req.grammar is None or req.grammar.accept(token):
            return False
        self.end(req, FinishReason("abort", message=f"token {token} breaks the request's grammar (the prefill and "
                                   "decode sides disagree)", status_code=500))
        return True

    def has_new_outputs(self) -> bool:
        """Some request has tokens or an end this step has not reported yet."""
        return bool(self._changed)

    def report(self, req: Req) -> None:
        """req's tokens so far go out with this step's outputs (those its role held back: `Role.holds_output`)."""
        self._changed[req.rid] = req

    def end(self, req: Req, reason: FinishReason) -> None:
        """Take req out of every queue and finish it (unless it already finished)."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req is self.chunked:
            self.chunked = None
        self.grammar_queue.remove(req)
        if req in self.running:
            self.running.remove(req)
        if not req.finished:
            self.finish(req, reason)

    def schedule_extend(self) -> list[ExtendItem]:
        """This step's prefill chunks: the chunked prompt first, then admitted waiting requests within the token
        budget, which the TPOT budget sets while requests decode (at most one of them chunked, and last)."""
        decoding = bool(self.running)
        queued = self.queued_prefill_tokens() if decoding and self.tpot_budget.enabled else None  # only read then
        budget = self.tpot_budget.extend_tokens(decoding=decoding, queued_tokens=queued)
        if budget == 0:
            return []
        items: list[ExtendItem] = []
        if self.chunked is not None:
            req, self.chunked = self.chunked, None
            item = self._plan_chunk(req, budget)
            if item is None:
                self.chunked = req
                return []
            items.append(item)
            budget -= item.end - item.start
        while self.waiting and budget > 0 and self._num_active() + len(items) < self.args.max_running_requests:
            req = self.waiting[0]
            if not self.admit(req, self._running_reserve()):
                break
            self.waiting.popleft()
            item = self._plan_chunk(req, budget)
            if item is None:
                self.release_pages(req)
                self.waiting.appendleft(req)
                break
            items.append(item)
            req.stage_marks.mark(ADMITTED)
            budget -= item.end - item.start
            if not item.completes_prefill:
                break  # at most one chunked request, and it is the last of the batch
        for item in items:
            if not item.completes_prefill:
                self.chunked = item.req
        return items

    def _num_active(self) -> int:
        return len(self.running) + (1 if self.chunked else 0)

    def admit(self, req: Req, reserved: int, handoff_reserve: int | None = None) -> bool:
        """Admission, the one rule for every way into the KV pool: req reuses the longest prefix of its prompt the
        prefix cache holds, and is admitted when the rest of the prompt plus its own growth reserve fit next to
        `reserved` pages held back for others' growth (pages the prefix cache could evict count as free); its hit
        is recorded then. Refused, it holds no page.

        Prefilled here (`handoff_reserve` None): its reserve is `decode_reserve`, it holds the prefix only (its
        chunks take the rest, `_plan_chunk`), and no prefix past where prompt logprobs still to compute begin.
        A PD handoff's destination: `handoff_reserve` pages of reserve, and pages for the whole prompt now (its
        prefill server writes all but the prefix)."""
        fill = req.all_ids
        if not req.pages:
            req.pages = self.radix.match_prefix(fill, self._prefix_limit(req, handoff_reserve is None), req.rid)
            req.num_cached_tokens = len(req.pages) * self.page_size
            req.num_prefix_hit = max(req.num_prefix_hit, req.num_cached_tokens)
        reserve = self.decode_reserve(req) if handoff_reserve is None else handoff_reserve
        need = math.ceil(len(fill) / self.page_size) - len(req.pages) + reserve
        fits = need + reserved <= self.available_pages()
        if fits and (handoff_reserve is None or self.ensure_pages(req, len(fill))):
            self.radix.record_hit(len(req.input_ids), req.num_cached_tokens)
            return True
        self.release_pages(req)
        return False

    def _prefix_limit(self, req: Req, computed_here: bool) -> int:
        """The most prompt tokens a cached prefix may cover: all but the last (its forward samples the first
        token), and where the prefill computes them, none whose logprob is still to compute."""
        limit = len(req.all_ids) - 1
        if computed_here and req.return_logprob and req.logprob_start_len >= 0 and not req.input_logprobs:
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        return limit

    def _running_reserve(self) -> int:
        """Pages held back for the running requests' growth."""
        return sum(self.decode_reserve(r) for r in self.running)

    def decode_reserve(self, req: Req) -> int:
        """Pages held back for req's growth while it decodes (a share of its remaining tokens)."""
        remaining = req.sampling_params.max_tokens - len(req.output_ids)
        remaining = min(remaining, self.context_len - req.seq_len)
        return math.ceil(max(remaining, 0) * self.decode_reserve_ratio / self.page_size)

    def available_pages(self) -> int:
        """Pages free now or once the prefix cache evicts what nobody else references."""
        return self.allocator.num_free + self.radix.evictable_pages()

    def _plan_chunk(self, req: Req, budget: int) -> ExtendItem | None:
        total = len(req.all_ids)
        start = req.num_cached_tokens
        end = min(total, start + budget)
        if end <= start or not self.ensure_pages(req, end):
            return None
        return ExtendItem(req, start, end)

    def ensure_pages(self, req: Req, num_tokens: int) -> bool:
        """req.pages hold num_tokens tokens (pages added as needed, evicting cached ones); False if KV runs out."""
        need = math.ceil(num_tokens / self.page_size) - len(req.pages)
        if need <= 0:
            return True
        pages = self.allocator.alloc(need)
        if pages is None:
            self.radix.evict(need - self.allocator.num_free)
            pages = self.allocator.alloc(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    # ---- forward passes ---------------------------------------------------------------------------------------

    def _run_extend(self, items: list[ExtendItem]) -> None:
        batch = ExtendBatch.of(items, self._wants_input_logprobs, self.page_size, self.device)
        self.radix.wait_for_loads()  # host pages of matched prefixes are on the device before the forward
        self.device_stamps.settle()  # earlier chunks' stamps, those not sampled in their own step
        marks = [item.req.stage_marks for item in items]
        self.device_stamps.mark_when_reached(marks, PREFILL_CHUNK_START)
        logits = self.runner.forward(batch.forward_batch, self.role.layer_hook(items))
        self.device_stamps.mark_when_reached(marks, PREFILL_CHUNK_END)
        for item, (first, count) in zip(items, batch.logit_rows):
            req = item.req
            req.num_cached_tokens = item.end
            if self._wants_input_logprobs(req):
                self._record_input_logprobs(req, item, logits[first : first + count])
            self.role.on_chunk_done(req, item.start, item.end)
        done, last_rows = batch.completed()
        if done:
            self._sample_and_append([i.req for i in done], logits[torch.tensor(last_rows, device=logits.device)])
            self.device_stamps.settle()  # sampling read the tokens back: this forward's stamps are in
            _mark_all(done, FIRST_TOKEN_SAMPLED)
            for item in done:
                if not item.req.finished:
                    self.role.on_prefill_done(item.req)

    def _run_decode(self) -> None:
        if self.overlap and self._launch_overlapped():
            return
        self._finish_inflight()
        self._make_room_for_decode()
        reqs = list(self.running)
        if not reqs:
            return
        state = self._input_batch_of(reqs)
        batch = self._decode_batch(state, [r.num_cached_tokens for r in reqs], [r.output_ids[-1] for r in reqs])
        if state.device_sampling_only() and not state.constrained:
            self._append_sampled(reqs, SampleResult(self._device_tokens(state, batch).tolist(), None, None))
        else:
            self._sample_and_append(reqs, self.runner.forward(batch), state.sampling)
        self.running = [r for r in self.running if not r.finished]

    def _launch_overlapped(self) -> bool:
        """Launch a decode batch whose inputs may still be on the device; then read back the previous batch
        (`overlap.py`). Returns False (nothing launched) when a request needs host-side sampling state or KV runs
        short."""
        reqs = list(self.running)
        state = self._input_batch_of(reqs)
        if not state.device_sampling_only():
            return False
        positions = [r.num_cached_tokens for r in reqs]  # rows still in flight included: their KV is on its way
        if not self._ensure_decode_pages(reqs, positions):
            return False
        prev = self.inflight
        input_ids, fix_ids = decode_inputs(prev, reqs, self.device)
        batch = self._decode_batch(state, positions, input_ids, fix_ids)
        if state.constrained:
            self._launch_constrained(state, batch, prev)
            return True
        self.inflight = InflightDecode(reqs, state.req_ids)
        self.inflight.sampled(self._device_tokens(state, batch), self.host_copier)
        if prev is not None:
            self._read_back(prev)
        return True

    def _launch_constrained(self, state: DecodeInputBatch, batch: ForwardBatch, prev: InflightDecode | None) -> None:
        """Launch the forward, read `prev` back while it runs (the matchers take its tokens), then fill the token
        bitmask of the rows still going and mask and sample on the device. The batch is in flight from the launch:
        pages of requests that end in the read-back wait for it."""
        logits = self.runner.forward(batch)
        self.inflight = launched = InflightDecode(state.reqs, state.req_ids)
        if prev is not None:
            self._read_back(prev)
        grammars = [None if r.finished else r.grammar for r in state.reqs]
        launched.sampled(self.sampler.sample_tokens(self._masked(logits, grammars), state.plain_rows, state.sampling),
                         self.host_copier)

    def _ensure_decode_pages(self, reqs: list[Req], positions: list[int]) -> bool:
        """A KV slot at every request's position; only requests whose last page is full get a new one."""
        ps = self.page_size
        full = [(r, p) for r, p in zip(reqs, positions) if p >= len(r.pages) * ps]
        return all(self.ensure_pages(r, p + 1) for r, p in full)

    def _finish_inflight(self) -> None:
        if self.inflight is not None:
            prev, self.inflight = self.inflight, None
            self._read_back(prev)

    def _read_back(self, batch: InflightDecode) -> None:
        if batch.done is not None:
            batch.done.synchronize()
        changed, check_stop, now = self._changed, self.role.check_stop, time.monotonic()
        for req, token in zip(batch.reqs, batch.host_tokens.tolist()):
            if req.finish_reason is not None or self._refused_by_grammar(req, token):
                continue  # ended while the batch ran (stop, abort) or its grammar refused the token: dropped
            req.output_ids.append(token)
            req.stage_marks.mark(OUTPUT_TOKEN, now)
            changed[req.rid] = req
            reason = check_stop(req)
            if reason is not None:
                self.finish(req, reason)
        self.running = [r for r in self.running if r.finish_reason is None]
        self.allocator.free(batch.deferred_pages)

    def _input_batch_of(self, reqs: list[Req]) -> DecodeInputBatch:
        """The persistent decode batch for these requests, rebuilt when its composition changed."""
        if self.input_batch is None or not self.input_batch.matches(reqs):
            max_pages = math.ceil(self.context_len / self.page_size)
            self.input_batch = DecodeInputBatch(reqs, self.page_size, max_pages, self.device)
        return self.input_batch

    def _decode_batch(self, state: DecodeInputBatch, positions: list[int], input_ids: list[int], fix_ids=None
                      ) -> ForwardBatch:
        """The decode pass over state.reqs where request i feeds input_ids[i] at positions[i] (its
        num_cached_tokens, the position after its computed KV, which this pass computes)."""
        batch = state.forward_batch(input_ids, positions)
        if fix_ids is not None:
            fix_ids(batch.input_ids)
        for r in state.reqs:
            r.num_cached_tokens += 1
        return batch

    def _device_tokens(self, state: DecodeInputBatch, batch: ForwardBatch) -> torch.Tensor:
        """Run the pass and sample it on the device, for a batch that needs no host-side sampling state
        (`state.device_sampling_only()`): inside the decode graph when every row is greedy or temperature-only."""
        tokens = self.runner.decode_tokens(batch, state.sampling)
        if tokens is None:
            tokens = self.sampler.sample_tokens(self.runner.forward(batch), state.plain_rows, state.sampling)
        return tokens

    def _make_room_for_decode(self) -> None:
        """Give every running request a slot for its next token, retracting the newest requests if KV runs out."""
        ps = self.page_size
        for req in list(self.running):
            if req.status is not ReqStatus.RUNNING or req.num_cached_tokens < len(req.pages) * ps:
                continue  # retracted earlier in this loop, or its last page has room for the next token
            while not self.ensure_pages(req, req.num_cached_tokens + 1):
                victim = self.running[-1]
                self._retract(victim)
                if victim is req:
                    break

    def _retract(self, req: Req) -> None:
        """Free a running request's KV and queue it first; it is recomputed from prompt + output so far."""
        self.running.remove(req)
        self.release_pages(req)
        req.status = ReqStatus.WAITING
        self.waiting.appendleft(req)
        self.num_retracted += 1
        logger.info("retracted request %s (KV cache full); it will be recomputed", req.rid)

    # ---- sampling and finishing -------------------------------------------------------------------------------

    def _sample_and_append(self, reqs: list[Req], logits: torch.Tensor, tensors: SamplingTensors | None = None) -> None:
        """`tensors`: the requests' sampling parameters already on the device, when the caller has them."""
        suppressed_ids = self.stop_checker.suppressed_ids
        rows = [  # fields by position: params, prompt_ids, output_ids, suppressed_ids, num_logprobs
            SamplingRow(r.sampling_params, r.input_ids, r.output_ids, suppressed_ids(r),
                        r.top_logprobs_num if r.return_logprob else None)
            for r in reqs
        ]
        logits = self._masked(logits, [r.grammar for r in reqs])
        self._append_sampled(reqs, self.sampler.sample(logits, rows, tensors))

    def _masked(self, logits: torch.Tensor, grammars: list[RequestGrammar | None]) -> torch.Tensor:
        """A float32 copy of `logits` where each row allows only what its grammar allows next; `logits` itself
        where no row has a grammar."""
        if not any(grammars):
            return logits
        self.num_masked_rows += sum(g is not None for g in grammars)
        self.num_masked_steps += 1
        return self.token_bitmask.mask(logits, grammars)

    def _append_sampled(self, reqs: list[Req], result: SampleResult) -> None:
        logprobs, tops = result.logprobs, result.top_logprobs
        for i, req in enumerate(reqs):
            if req.sampling_params.max_tokens == 0:
                self.finish(req, FinishReason("length", message=None))
            elif logprobs is None:
                self.add_token(req, result.token_ids[i])
            else:
                self.add_token(req, result.token_ids[i], logprobs[i], tops[i])

    def _wants_input_logprobs(self, req: Req) -> bool:
        return req.return_logprob and req.logprob_start_len >= 0 and len(req.input_logprobs) < len(req.input_ids)

    def _record_input_logprobs(self, req: Req, item: ExtendItem, logits: torch.Tensor) -> None:
        """logits row j scores token item.start + j + 1 (the first prompt token has no logprob)."""
        if not req.input_logprobs:
            req.input_logprobs.append(None)
            req.input_top_logprobs.append(None)
        targets = req.input_ids[item.start + 1 : item.end + 1]
        if not targets:
            return
        values, tops = prompt_logprobs(logits, targets, req.top_logprobs_num)
        req.input_logprobs.extend(values)
        req.input_top_logprobs.extend(tops)

    def finish(self, req: Req, reason: FinishReason) -> None:
        """req ends now: its KV goes to the prefix cache (unless aborted) and its pages are released."""
        req.finish_reason = reason
        req.status = ReqStatus.FINISHED
        if reason.type != "abort" and self.role.caches_finished(req):
            self.cache_kv(req)
        self.release_pages(req)
        self._changed[req.rid] = req

    def release_pages(self, req: Req) -> None:
        """Drop req's page references, unless its role keeps them (then whoever holds them releases them later);
        pages a launched decode batch still writes are freed once it has been read back."""
        if self.role.keeps_pages(req):
            return
        if self.inflight is not None and id(req) in self.inflight.req_ids:
            self.inflight.deferred_pages.extend(req.pages)  # the launched batch still writes this KV
        else:
            self.allocator.free(req.pages)
        req.pages = []
        req.num_cached_tokens = 0

    def _pages_in_use_by_reqs(self) -> bool:
        return any(r.pages for r in self.reqs.values())

    def _collect_outputs(self) -> list[TokenOut]:
        outputs = []
        for req in self._changed.values():
            if req.finish_reason is None and self.role.holds_output(req):
                continue  # the role reports it later (`report`)
            outputs.append(self._make_output(req))
            if req.finish_reason is not None:
                self.reqs.pop(req.rid, None)
        self._changed.clear()
        return outputs

    def _make_output(self, req: Req) -> TokenOut:
        """The detokenizer's message: the tokens since the previous report, and the prompt logprobs in the first."""
        start = req.num_reported
        req.num_reported = len(req.output_ids)
        if start == 0 and req.output_ids:
            req.stage_marks.mark(FIRST_TOKEN_EMITTED)
        reason = req.finish_reason
        input_logprobs = input_top_logprobs = None
        if req.return_logprob and start == 0 and req.logprob_start_len >= 0:
            prompt_start = min(req.logprob_start_len, len(req.input_ids))
            input_logprobs = req.input_logprobs[prompt_start:]
            input_top_logprobs = req.input_top_logprobs[prompt_start:]
        logprobs = req.return_logprob
        return TokenOut(  # by position: built for every request at every step, where keywords cost more
            req.rid, req.output_ids[start:], None if reason is None else reason.to_dict(), len(req.input_ids),
            req.num_reported, req.num_prefix_hit, req.output_logprobs[start:] if logprobs else [],
            req.output_top_logprobs[start:] if logprobs else [], input_logprobs, input_top_logprobs,
            req.stage_marks.take(),
        )


def _mark_all(items: list[ExtendItem], stage: str) -> None:
    """Marks `stage` now for the request of every item."""
    now = time.monotonic()
    for item in items:
        item.req.stage_marks.mark(stage, now)
