"""Tensor parallelism on the CPU (gloo, fp32): the offline API with two ranks generates what HF does, for each
architecture and with a KV head replicated on both ranks; a model that cannot be split is refused; the group closes
in order with its followers, aborts when one is gone, and a rendezvous without peers fails in bounded time; a
follower that dies while the group forms or the engine starts fails rank 0's start at once, naming it."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from tensor_parallel_child import exit_with, join_then_exit, run_engine
from test_hf_equivalence import greedy, hf_greedy, random_prompts
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from pdserve import llm as llm_module
from pdserve.config import ConfigError
from pdserve.distributed import tensor_parallel
from pdserve.distributed.tensor_parallel import FollowerDied, FollowerWatch, GroupClosed, TPGroup, init_tp_group
from pdserve.layers.linear import Shard
from pdserve.models.model_config import ModelConfig
from pdserve.ports import free_port

MAX_NEW = 8


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny", "qwen3-tiny", "llama-tiny-mqa"])
def test_tp2_greedy_matches_hf(tiny_models, preset):
    path = tiny_models[preset]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = random_prompts([1, 9, 40], hf.config.vocab_size, seed=3)  # 40 > the chunk: two chunks
    llm = LLM(path, tp_size=2, device="cpu", dtype="float32", page_size=4, chunked_prefill_size=32,
              max_prefill_tokens=32, max_total_tokens=1024)
    try:
        outs = llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
        assert [o.token_ids for o in outs] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
        # sampled decoding: every rank draws the same token from the same gathered logits, or the ranks would part
        sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=MAX_NEW, ignore_eos=True, seed=7)
        first, again = (llm.generate(prompts, sampled, use_tqdm=False) for _ in range(2))
        assert [o.token_ids for o in first] == [o.token_ids for o in again]
        assert all(len(o.token_ids) == MAX_NEW for o in first)
        assert llm.scheduler.kv_pool_is_fully_free()
        assert llm.scheduler.runner.pool.layout.num_kv_heads == max(1, hf.config.num_key_value_heads // 2)
    finally:
        llm.shutdown()


def test_kv_heads_are_split_or_replicated():
    # 4 KV heads over 2 ranks: two each; 1 KV head over 2 ranks: both hold head 0; 2 over 4: heads 0, 0, 1, 1
    assert [Shard.kv_heads(4, 8, TPGroup(r, 2)) for r in range(2)] == [Shard(32, 0, 16), Shard(32, 16, 16)]
    assert [Shard.kv_heads(1, 8, TPGroup(r, 2)).start for r in range(2)] == [0, 0]
    assert [Shard.kv_heads(2, 8, TPGroup(r, 4)).start for r in range(4)] == [0, 0, 8, 8]


@pytest.mark.parametrize("tp_size,message", [
    (3, "--tp-size 3 does not divide this model's num_attention_heads 4"),
    (8, "--tp-size 8 does not divide this model's num_attention_heads 4"),
])
def test_head_counts_the_tp_size_does_not_divide_are_refused(tiny_model, tp_size, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_path(tiny_model).check_tp_size(tp_size)


def test_kv_heads_that_cannot_be_replicated_evenly_are_refused(tiny_model):
    cfg = ModelConfig.from_path(tiny_model)
    odd = ModelConfig(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "num_heads": 12, "num_kv_heads": 3,
                         "intermediate_size": 192})
    with pytest.raises(ConfigError, match="num_key_value_heads 3"):
        odd.check_tp_size(4)


def _followers(llm: LLM) -> list:
    return llm._shutdown.peek()[2][0]  # _stop_ranks's arguments: the follower processes, the group


def test_shutdown_closes_the_group_with_the_followers_and_a_new_one_forms(tiny_model):
    """The leader's close reaches the followers waiting in the message broadcast: they leave the group with it and
    exit 0 on their own (not terminated or killed), and this process can form the next group."""
    for _ in range(2):
        llm = LLM(tiny_model, tp_size=2, device="cpu", dtype="float32", page_size=4, max_total_tokens=512,
              skip_server_warmup=True)
        followers = _followers(llm)
        assert llm.generate([[1, 2, 3]], greedy(2), use_tqdm=False)[0].token_ids
        llm.shutdown()
        assert [p.exitcode for p in followers] == [0]
        assert not dist.is_initialized()


def test_shutdown_with_a_dead_follower_aborts_the_group_in_bounded_time(tiny_model, monkeypatch):
    monkeypatch.setattr(tensor_parallel, "CLOSE_TIMEOUT", timedelta(seconds=5))
    llm = LLM(tiny_model, tp_size=2, device="cpu", dtype="float32", page_size=4, max_total_tokens=512,
              skip_server_warmup=True)
    follower = _followers(llm)[0]
    os.kill(follower.pid, signal.SIGKILL)
    follower.join(30)
    start = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - start < 60  # the close's wait, bounded, then abort: no peer needed
    assert not dist.is_initialized()


def test_rendezvous_without_the_other_ranks_fails_in_bounded_time(monkeypatch):
    monkeypatch.setattr(tensor_parallel, "RENDEZVOUS_TIMEOUT", timedelta(seconds=2))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the group did not form on 127.0.0.1"):
        init_tp_group(2, 0, free_port(), torch.device("cpu"))
    assert time.monotonic() - start < 30
    assert not dist.is_initialized()


def _spawned(target, *args) -> multiprocessing.Process:
    process = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    process.start()
    return process


# Each test below would wait out RENDEZVOUS_TIMEOUT (5 min) or COLLECTIVE_TIMEOUT (10 min) without the watch.
WATCHED_FAILURE_S = 60  # a spawned interpreter's start on a loaded 2-core box, with room


def test_a_follower_dead_before_the_rendezvous_fails_it_at_once():
    follower = _spawned(exit_with, 3)
    start = time.monotonic()
    with pytest.raises(FollowerDied, match=rf"rank 1 \(pid {follower.pid}\) exited with code 3"):
        with FollowerWatch([follower]):
            init_tp_group(2, 0, free_port(), torch.device("cpu"))
    assert time.monotonic() - start < WATCHED_FAILURE_S
    assert not dist.is_initialized()


def test_a_follower_dead_before_the_first_collective_is_named():
    port = free_port()
    follower = _spawned(join_then_exit, port, 5)
    start = time.monotonic()
    try:
        with pytest.raises(FollowerDied, match=r"rank 1 \(pid \d+\) exited with code 5") as died:
            with FollowerWatch([follower]):
                tp = init_tp_group(2, 0, port, torch.device("cpu"))
                follower.join(WATCHED_FAILURE_S)  # gone before the collective begins, or during it: the same
                tp.barrier()
        assert isinstance(died.value.__cause__, RuntimeError)  # gloo's error, kept as the cause
        assert time.monotonic() - start < WATCHED_FAILURE_S * 2
    finally:
        tensor_parallel.abort_group()
    assert not dist.is_initialized()


def test_the_leaders_own_start_error_is_not_blamed_on_its_followers():
    follower = _spawned(exit_with, 4)
    follower.join(WATCHED_FAILURE_S)
    with pytest.raises(ValueError, match="a flag the model refutes"):
        with FollowerWatch([follower]):
            raise ValueError("a flag the model refutes")


def test_the_offline_llm_fails_its_start_at_once_when_a_follower_dies(tiny_model, monkeypatch):
    monkeypatch.setattr(llm_module, "_spawn_followers", lambda args: [_spawned(exit_with, 7)])
    start = time.monotonic()
    with pytest.raises(FollowerDied, match="rank 1 .* exited with code 7"):
        LLM(tiny_model, tp_size=2, device="cpu", dtype="float32", page_size=4, max_total_tokens=512,
            skip_server_warmup=True)
    assert time.monotonic() - start < WATCHED_FAILURE_S
    assert not dist.is_initialized()


def test_a_follower_leaves_on_the_leaders_close(monkeypatch):
    """Two ranks in threads of one process cannot share torch's default group, so the follower's side is checked on
    its own: the close length ends its wait in the broadcast with GroupClosed, after it has left the group."""
    left = []
    follower = TPGroup(1, 2)
    monkeypatch.setattr(TPGroup, "_leave", lambda self: left.append(self.rank))
    monkeypatch.setattr(dist, "broadcast", lambda tensor, src, group: tensor.fill_(tensor_parallel._CLOSE))
    with pytest.raises(GroupClosed):
        follower.broadcast_messages(None)
    assert left == [1]


def test_the_gpu_tests_engine_process_runs_and_shuts_down(tiny_model, tmp_path):
    """The GPU tests' harness (an engine in a process of its own under a time limit), here on the CPU."""
    engine = {"device": "cpu", "dtype": "float32", "tp_size": 2, "page_size": 4, "max_total_tokens": 512,
              "skip_server_warmup": True}
    result = run_engine(tiny_model, engine, [[1, 2, 3], [4, 5, 6, 7]], 3, tmp_path / "tp2", 240)
    assert [len(o) for o in result["outputs"]] == [3, 3]
    assert [len(lps) for lps in result["prompt_logprobs"]] == [2, 3]
    assert result["pool_free"] and result["follower_exit_codes"] == [0]
    assert result["shutdown_s"] < tensor_parallel.CLOSE_TIMEOUT.total_seconds()
