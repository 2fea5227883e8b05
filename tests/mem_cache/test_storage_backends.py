"""Tier-3 building blocks: the checked block format and the file backend (atomic, bounded, several writers)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdserve.mem_cache.storage.base import BlockError, chain_hashes, decode_block, encode_block, root_hash
from pdserve.mem_cache.storage.file import FileStorage


def test_block_roundtrip_and_every_kind_of_damage_is_refused():
    payload = bytes(range(256)) * 4
    block = encode_block("k1", payload)
    assert decode_block(block, "k1", len(payload)) == payload
    with pytest.raises(BlockError, match="another key"):
        decode_block(block, "k2", len(payload))
    flipped = bytearray(block)
    flipped[-1] ^= 1
    with pytest.raises(BlockError, match="checksum"):
        decode_block(bytes(flipped), "k1", len(payload))
    with pytest.raises(BlockError, match="payload bytes"):
        decode_block(block[:-8], "k1", len(payload))
    with pytest.raises(BlockError, match="not a pdserve"):
        decode_block(b"garbage", "k1", len(payload))


def test_hash_chain_depends_on_identity_and_the_whole_prefix():
    a, b = root_hash(b"model-a"), root_hash(b"model-b")
    assert chain_hashes(a, [[1, 2], [3, 4]])[1] != chain_hashes(b, [[1, 2], [3, 4]])[1]
    assert chain_hashes(a, [[1, 2], [3, 4]])[1] != chain_hashes(a, [[9, 2], [3, 4]])[1]
    assert chain_hashes(a, [[1, 2], [3, 4]])[:1] == chain_hashes(a, [[1, 2]])


def test_file_backend_survives_reopen_and_evicts_lru_past_its_bound(tmp_path):
    store = FileStorage(str(tmp_path), capacity_bytes=10_000)
    long_ago = time.time() - 1000
    for i in range(5):
        store.put(f"key{i}", bytes(1000))
        os.utime(store._path(f"key{i}"), (long_ago + i, long_ago + i))  # a use order that timestamps cannot tie
    assert store.get("key0") == bytes(1000)  # refreshes key0
    for i in range(5, 12):
        store.put(f"key{i}", bytes(1000))
    reopened = FileStorage(str(tmp_path), capacity_bytes=10_000)
    assert reopened.exists("key11") and reopened.exists("key0")  # newest and recently read survive
    assert not reopened.exists("key1")  # least recently used went first
    assert reopened._scan_usage() <= 10_000
    assert not [n for n in os.listdir(tmp_path / "ke") if n.endswith(".tmp")]


def test_file_backend_with_concurrent_writers_in_several_processes(tmp_path):
    writer = (
        "import sys; from pdserve.mem_cache.storage.file import FileStorage;"
        "from pdserve.mem_cache.storage.base import encode_block;"
        "s = FileStorage(sys.argv[1]);"
        "[s.put(f'key{i % 20}', encode_block(f'key{i % 20}', bytes([int(sys.argv[2])]) * 4096)) for i in range(300)]"
    )
    procs = [subprocess.Popen([sys.executable, "-c", writer, str(tmp_path), str(n)]) for n in (1, 2)]
    store = FileStorage(str(tmp_path))
    while any(p.poll() is None for p in procs):
        for i in range(20):
            block = store.get(f"key{i}")
            if block is not None:  # a reader sees a whole block from one writer, never a torn one
                assert decode_block(block, f"key{i}", 4096) in (bytes([1]) * 4096, bytes([2]) * 4096)
    assert all(p.wait(timeout=60) == 0 for p in procs)
    assert all(store.exists(f"key{i}") for i in range(20))
