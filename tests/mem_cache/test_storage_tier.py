"""Tier 3: a prefix computed by one instance is reused by another and after a restart; damaged blocks and dead
backends fall back to recompute with correct output."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time

import pytest
from hicache_util import PAGE_SIZE, assert_pools_free, hicache, prompts, run, tiered_llm

from pdserve.ports import free_port
from pdserve.mem_cache.storage.base import chain_hashes
from pdserve.mem_cache.storage.file import FileStorage


def file_llm(model: str, storage_dir, **kw):
    return tiered_llm(model, hicache_storage_backend="file", hicache_storage_dir=str(storage_dir),
                      hicache_storage_prefetch_policy="wait_complete", **kw)


def close(llm) -> None:
    assert llm.scheduler.radix.wait_for_writes(timeout=30)
    llm.scheduler.radix.close()


def test_file_backend_prefix_reused_by_another_instance_and_after_restart(tiny_model, hf_greedy, tmp_path):
    (base,) = prompts(64, seed=2)
    first = file_llm(tiny_model, tmp_path, hicache_mem_layout="layer_first")  # blocks are the same in both layouts
    run(first, base)
    assert first.scheduler.radix.wait_for_writes(timeout=30)
    assert hicache(first, "stored_bytes_total", "storage") > 0
    second = file_llm(tiny_model, tmp_path, hicache_write_policy="write_back")
    followup = base + [5, 6]
    out = run(second, followup)
    assert out.cached_tokens == 64
    assert hicache(second, "hit_tokens_total", "storage") == 64
    assert out.token_ids == hf_greedy(followup)
    assert_pools_free(second)
    close(first)
    close(second)
    restarted = file_llm(tiny_model, tmp_path)
    again = base + [9]
    out = run(restarted, again)
    assert out.cached_tokens == 64 and out.token_ids == hf_greedy(again)
    assert_pools_free(restarted)
    close(restarted)


def test_corrupted_block_is_dropped_and_recomputed(tiny_model, hf_greedy, tmp_path):
    (base,) = prompts(64, seed=3)
    writer = file_llm(tiny_model, tmp_path)
    run(writer, base)
    close(writer)
    reader = file_llm(tiny_model, tmp_path)
    pages = [base[i * PAGE_SIZE : (i + 1) * PAGE_SIZE] for i in range(3)]
    third_key = chain_hashes(reader.scheduler.radix._root_hash, pages)[2].hex()
    path = FileStorage(str(tmp_path))._path(third_key)
    data = bytearray(open(path, "rb").read())
    data[-5] ^= 0xFF  # one flipped byte in the KV payload
    open(path, "wb").write(bytes(data))
    followup = base + [4]
    out = run(reader, followup)
    assert out.cached_tokens == 2 * PAGE_SIZE  # the two pages before the damaged block
    assert hicache(reader, "corrupt_blocks_total", "storage") == 1
    assert out.token_ids == hf_greedy(followup)
    assert_pools_free(reader)
    close(reader)
    assert FileStorage(str(tmp_path)).get(third_key) is not None  # rewritten from the recomputed page
    assert open(path, "rb").read() != bytes(data)


def test_unusable_file_backend_degrades_to_recompute(tiny_model, hf_greedy, tmp_path):
    not_a_dir = tmp_path / "occupied"
    not_a_dir.write_text("a file where the storage directory should be")
    (base,) = prompts(64, seed=4)
    llm = file_llm(tiny_model, not_a_dir)
    assert llm.scheduler.radix.storage is None
    assert hicache(llm, "backend_errors_total", "storage") == 1
    assert run(llm, base).token_ids == hf_greedy(base)
    close(llm)


def test_file_backend_dying_mid_run_degrades_to_recompute(tiny_model, hf_greedy, tmp_path):
    storage_dir = tmp_path / "store"
    llm = file_llm(tiny_model, storage_dir)
    shutil.rmtree(storage_dir)
    storage_dir.write_text("the mount went away")
    first, second = prompts(64, 64, seed=5)
    assert run(llm, first).token_ids == hf_greedy(first)
    assert llm.scheduler.radix.wait_for_writes(timeout=30)
    assert hicache(llm, "backend_errors_total", "storage") > 0  # writes failed
    assert run(llm, second).token_ids == hf_greedy(second)
    assert_pools_free(llm)
    close(llm)


@pytest.fixture()
def mooncake_master(tmp_path):
    binary = shutil.which("mooncake_master")
    if binary is None:
        pytest.skip("mooncake_master is not installed")
    port = free_port()
    log = open(tmp_path / "mooncake_master.log", "w")
    proc = subprocess.Popen([binary, f"--rpc_port={port}", "--rpc_address=127.0.0.1",
                             f"--metrics_port={free_port()}"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, (tmp_path / "mooncake_master.log").read_text()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "mooncake_master did not start listening"
            time.sleep(0.1)
    yield f"127.0.0.1:{port}"
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


def mooncake_llm(model: str, address: str):
    extra = {"master_server_address": address, "global_segment_size": 32 << 20, "local_buffer_size": 16 << 20}
    return tiered_llm(model, hicache_storage_backend="mooncake", hicache_storage_prefetch_policy="timeout",
                      hicache_storage_backend_extra_config=json.dumps({**extra, "prefetch_timeout_base": 10}))


def test_mooncake_store_prefix_reused_by_another_instance(tiny_model, hf_greedy, mooncake_master):
    (base,) = prompts(64, seed=6)
    first = mooncake_llm(tiny_model, mooncake_master)
    assert first.scheduler.radix.storage.wait_ready(60)
    run(first, base)
    assert first.scheduler.radix.wait_for_writes(timeout=30)
    assert hicache(first, "backend_errors_total", "storage") == 0
    second = mooncake_llm(tiny_model, mooncake_master)
    assert second.scheduler.radix.storage.wait_ready(60)
    followup = base + [3]
    out = run(second, followup)
    assert out.cached_tokens == 64 and hicache(second, "hit_tokens_total", "storage") == 64
    assert out.token_ids == hf_greedy(followup)
    assert_pools_free(second)
    close(second)  # the second client holds part of the store's memory: leave before the first
    close(first)


def test_unreachable_mooncake_master_degrades_to_recompute(tiny_model, hf_greedy):
    llm = mooncake_llm(tiny_model, f"127.0.0.1:{free_port()}")  # nothing listens there
    (base,) = prompts(40, seed=7)
    assert run(llm, base).token_ids == hf_greedy(base)
    assert hicache(llm, "backend_errors_total", "storage") > 0
    assert_pools_free(llm)
    llm.scheduler.radix.close()
