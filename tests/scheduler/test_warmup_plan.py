"""The warm-up plan reaches what traffic reaches: prompt lengths, batch sizes and prefix-hit extends in every
residue class Triton specializes on (== 1, = 0 and != 0 mod 16, odd), and, where a grammar backend is configured,
constrained batches of every row count class xgrammar's bitmask kernel specializes on; running it on a real
scheduler does run those extends over a cached prefix and masks those rows, then leaves nothing behind."""

from __future__ import annotations

import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from pdserve import LLM
from pdserve.config import ServerArgs
from pdserve.scheduler.warmup import (CPU_CONSTRAINED, MAX_NEW_TOKENS, PREFIX_EXTENSIONS, gpu_plan, warm_up,
                                      warmup_plan)

PAGE_SIZE = 16


def residue_classes(lengths) -> set[str]:
    classes = set()
    for n in lengths:
        classes.add("one" if n == 1 else "multiple of 16" if n % 16 == 0 else "odd" if n % 2 else "even")
    return classes


ALL_CLASSES = {"one", "multiple of 16", "odd", "even"}


def test_prompts_alone_and_in_batches_cover_every_residue_class_and_batch_size():
    plan = gpu_plan(room=16000, chunk=8192, page_size=PAGE_SIZE, prefix_cache=True)
    assert residue_classes(plan.alone) == ALL_CLASSES
    assert max(plan.alone) > 8192  # a prompt longer than a chunk
    assert {len(b) for b in plan.batches} | {1} == {1, 2, 3, 4}  # every batch size mod 4: the tensors' offsets
    assert all(len(set(b)) == len(b) for b in plan.batches)  # mixed lengths
    assert residue_classes(n for b in plan.batches for n in b) >= {"one", "multiple of 16", "odd"}


def test_prefix_hit_extends_cover_every_residue_class_over_whole_pages():
    plan = gpu_plan(room=16000, chunk=8192, page_size=PAGE_SIZE, prefix_cache=True)
    assert plan.prefix > 0 and plan.prefix % PAGE_SIZE == 0
    assert residue_classes(plan.extensions) == {"one", "multiple of 16", "odd"}
    assert gpu_plan(room=16000, chunk=8192, page_size=PAGE_SIZE, prefix_cache=False).extensions == ()


def test_with_a_grammar_backend_constrained_batches_cover_every_row_count_class():
    plan = gpu_plan(room=16000, chunk=8192, page_size=PAGE_SIZE, prefix_cache=True, grammar_rows=256)
    assert residue_classes(plan.constrained) == {"one", "multiple of 16", "odd"}
    assert gpu_plan(room=16000, chunk=8192, page_size=PAGE_SIZE, prefix_cache=True).constrained == ()
    small = gpu_plan(room=16000, chunk=8192, page_size=PAGE_SIZE, prefix_cache=False, grammar_rows=8)
    assert max(small.constrained) == 8  # no batch holds more than --max-running-requests


def scheduler_stub(tiny_model, device: str, **args) -> SimpleNamespace:
    """What `warmup_plan` reads of a scheduler."""
    return SimpleNamespace(args=ServerArgs(model_path=tiny_model, device=device, **args), device=torch.device(device),
                           context_len=4096, allocator=SimpleNamespace(capacity=1024), page_size=PAGE_SIZE)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_plan_runs_constrained_requests_where_a_grammar_backend_is_configured(tiny_model, device, monkeypatch):
    plan = warmup_plan(scheduler_stub(tiny_model, device))
    assert plan.constrained == (CPU_CONSTRAINED if device == "cpu" else (1, 3, 16))
    assert warmup_plan(scheduler_stub(tiny_model, device, grammar_backend="none")).constrained == ()
    assert warmup_plan(scheduler_stub(tiny_model, device, max_running_requests=2)).constrained[-1] <= 2
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # not installed: no backend
    assert warmup_plan(scheduler_stub(tiny_model, device)).constrained == ()


def test_a_small_context_clamps_every_length():
    plan = gpu_plan(room=100, chunk=64, page_size=PAGE_SIZE, prefix_cache=True)
    assert max(plan.alone) == 100 and all(n <= 100 for b in plan.batches for n in b)
    assert plan.prefix + max(plan.extensions) <= 100


@pytest.fixture(scope="module")
def cold_llm(tiny_model):
    return LLM(tiny_model, device="cpu", max_total_tokens=8192, context_length=512, chunked_prefill_size=128,
               skip_server_warmup=True)


def test_the_gpu_plan_runs_its_prefix_hit_extends_and_constrained_batches_and_leaves_no_trace(cold_llm):
    pytest.importorskip("xgrammar")
    sched = cold_llm.scheduler
    plan = gpu_plan(room=300 - MAX_NEW_TOKENS, chunk=128, page_size=sched.page_size, prefix_cache=True,
                    grammar_rows=sched.args.max_running_requests)
    report = warm_up(sched, plan)
    extended_over_prefix = Counter(report.prefix_hit_extends)
    assert all(extended_over_prefix[n] >= 2 for n in PREFIX_EXTENSIONS), report  # alone, then all together
    assert sum(PREFIX_EXTENSIONS) in report.extend_tokens
    assert {1, 2, 3, 4, 16} <= set(report.decode_batch_sizes)
    assert report.constrained_batches == (1, 3, 16)
    assert report.masked_rows == MAX_NEW_TOKENS * sum(report.constrained_batches)  # every row, every token
    stats = sched.stats()
    assert stats["prefix_query_tokens"] == stats["prefix_hit_tokens"] == stats["kv_cached_tokens"] == 0
    assert stats["constrained_requests"] == stats["grammar_compiles"] == stats["grammar_masked_rows"] == 0
    assert sched.kv_pool_is_fully_free() and not sched.grammar_queue.compiler.cache
