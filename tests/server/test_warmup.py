"""Warm start: a server (or `LLM`) runs its warm-up pass before it reports ready, over the expected shapes (a
request under a grammar among them), and leaves no trace of it (cache, hit counts, sampler seed, prefill rate,
grammar counters)."""

from __future__ import annotations

import pytest

from server_util import parse_prometheus

from pdserve import LLM, SamplingParams
from pdserve.scheduler.warmup import CONSTRAINED_PROMPT, CPU_CONSTRAINED, CPU_PLAN, MAX_NEW_TOKENS, SAMPLINGS

BUCKET = CPU_PLAN.alone[0]
# one prompt alone, one per sampling in a batch (a batched decode), then the constrained request
EXPECTED_EXTEND_TOKENS = [BUCKET, BUCKET * len(SAMPLINGS), CONSTRAINED_PROMPT * CPU_CONSTRAINED[0]]


def test_server_is_ready_only_after_its_warm_up(server):
    log = server.log()
    assert "warm-up done" in log and "pdserve is ready" in log, log
    assert log.index("warm-up done") < log.index("pdserve is ready")
    warmup = server.get("/get_server_info").json()["model_info"]["warmup"]
    assert warmup["prompt_lengths"] == [BUCKET] and warmup["samplings"] == list(SAMPLINGS)
    assert warmup["extend_tokens"] == EXPECTED_EXTEND_TOKENS
    assert len(SAMPLINGS) in warmup["decode_batch_sizes"]
    assert warmup["constrained_batches"] == list(CPU_CONSTRAINED) and warmup["masked_rows"] == MAX_NEW_TOKENS
    assert "constrained batches of [1] (3 masked rows)" in log


def test_compiles_after_ready_are_counted_and_exported(server):
    """On the CPU nothing is compiled: the counter is there, at 0."""
    assert server.get("/get_server_info").json()["scheduler"]["compiles_after_ready"] == 0
    assert parse_prometheus(server.get("/metrics").body.decode())["pdserve_compiles_after_ready_total"] == 0


@pytest.fixture(scope="module")
def warmed_and_cold(tiny_model):
    args = dict(device="cpu", max_total_tokens=4096, context_length=256)
    return LLM(tiny_model, **args), LLM(tiny_model, skip_server_warmup=True, **args)


def test_the_warm_up_leaves_the_grammar_compiler_ready_for_the_first_schema(warmed_and_cold):
    """The tokenizer's grammar tables (seconds for a large vocabulary) are built before ready: a first schema pays
    only for its own new states (tests/constrained/test_grammar_queue.py: over how many threads)."""
    compiler = warmed_and_cold[0].scheduler.grammar_queue.compiler
    assert compiler is not None and compiler.vocabulary.done() and compiler.vocabulary.exception() is None


def test_offline_warm_up_runs_the_shapes_and_leaves_no_trace(warmed_and_cold):
    warmed, cold = warmed_and_cold
    assert cold.warmup is None
    report = warmed.warmup
    assert list(report.extend_tokens) == EXPECTED_EXTEND_TOKENS and len(SAMPLINGS) in report.decode_batch_sizes
    stats = warmed.scheduler.stats()
    assert stats["prefix_query_tokens"] == stats["prefix_hit_tokens"] == stats["kv_cached_tokens"] == 0
    assert stats["prefill_tokens_per_s"] == 0.0 and warmed.scheduler.kv_pool_is_fully_free()
    assert stats["constrained_requests"] == stats["grammar_compiles"] == stats["grammar_masked_rows"] == 0
    sampled = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, ignore_eos=True)  # the shared generator
    constrained = SamplingParams(temperature=0.9, max_tokens=12, regex="[a-z]+ [0-9]{2,}")  # both wait for one compile
    prompts = ["The capital of France is", "Once upon a time"]
    for params in (sampled, constrained):
        assert [o.token_ids for o in warmed.generate(prompts, params, use_tqdm=False)] == \
            [o.token_ids for o in cold.generate(prompts, params, use_tqdm=False)]
    assert warmed.scheduler.stats()["grammar_compiles"] == cold.scheduler.stats()["grammar_compiles"] == 1
