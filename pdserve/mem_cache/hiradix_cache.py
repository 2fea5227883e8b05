"""Hierarchical radix cache: one prefix tree over three tiers (device pages, host pages, shared storage).

Each node is one page and records which tiers hold it: `page` (device, -1 when evicted), `host_page` (host,
-1 when absent) and `stored` (tier 3 has its block). Device residency stays closed under prefixes (only device
leaves are evicted, loads fill a path from the top), and every node in the tree is held by the device or the
host. Device eviction keeps the page on the host (`write_back`), or finds it already there (`write_through`
copies each page to the host when it enters the tree); the host tier evicts its own LRU pages. A page
written to the host is also put into storage by a writer thread. `match_prefix` loads host-only nodes of the
matched path into fresh device pages and then continues the match from storage with the blocks prefetched
for the request; on CUDA loads run on their own stream and `wait_for_loads` makes the next forward wait.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import os
import queue
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import torch

from pdserve.mem_cache.host_pool import HostKVPool
from pdserve.mem_cache.kv_pool import KVLayout, KVPool, PageAllocator
from pdserve.mem_cache.radix_cache import RadixCache, _clock, _Node
from pdserve.mem_cache.stats import HiCacheStats
from pdserve.mem_cache.storage.base import (
    BlockError, StorageBackend, chain_hashes, decode_block, encode_block, root_hash,
)

logger = logging.getLogger(__name__)

_MAX_PREFETCHES = 256


@dataclass(frozen=True, slots=True)
class HiCachePolicy:
    write_policy: str = "write_through"  # write_through | write_back
    prefetch_policy: str = "best_effort"  # best_effort | wait_complete | timeout
    prefetch_timeout_base: float = 0.5  # seconds (timeout policy)
    prefetch_timeout_per_ki_token: float = 0.25  # seconds per 1024 prefetched tokens (timeout policy)
    wait_complete_limit: float = 60.0  # wait_complete still gives up after this long


@dataclass(frozen=True, slots=True)
class _Prefetch:
    start: int  # page index of the first block looked up
    num_tokens: int
    future: Future  # -> list[(block hash, payload)], consecutive from `start`


class HiRadixCache(RadixCache):
    def __init__(self, allocator: PageAllocator, device_pool: KVPool, host_pool: HostKVPool,
                 storage: StorageBackend | None, identity: bytes, policy: HiCachePolicy,
                 stats: HiCacheStats | None = None):
        super().__init__(allocator, device_pool.layout.page_size)
        self.device = device_pool
        self.host = host_pool
        self.storage = storage
        self.policy = policy
        self.stats = stats or HiCacheStats()
        self._root_hash = root_hash(identity)
        self._new_cached: list[_Node] = []
        self._protected: set[int] = set()  # ids of host-only nodes a match is about to load
        self._busy: Counter[int] = Counter()  # host pages a storage write still reads
        self._deferred_free: set[int] = set()  # host pages to free once their write is done
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # host pages whose write finished
        self._writes: list[Future] = []
        self._prefetches: OrderedDict[str, _Prefetch] = OrderedDict()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="hicache-read") if storage else None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="hicache-write") if storage else None
        self._load_stream = torch.cuda.Stream(device_pool.buffer.device) if device_pool.buffer.is_cuda else None
        self._load_event: torch.cuda.Event | None = None
        self._timed_loads: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # (tier, start, end) in flight

    # ---- the RadixCache interface --------------------------------------------------------------------------

    def match_prefix(self, token_ids: list[int], max_tokens: int, rid: str | None = None) -> list[int]:
        self._drain_writes()
        self._count_copy_times()
        max_pages = max_tokens // self.page_size
        path = self._walk(token_ids, max_pages, touch=True)
        on_device = next((i for i, n in enumerate(path) if n.page < 0), len(path))
        pages = [n.page for n in path[:on_device]]
        self.allocator.incref(pages)
        self._count_lookup("device", max_pages, on_device)
        if on_device < len(path):
            loaded = self._load_from_host(path[on_device:])
            self._count_lookup("host", max_pages - on_device, len(loaded))
            pages += loaded
        if len(pages) == len(path) and self.storage is not None and len(path) < max_pages:
            parent = path[-1] if path else self.root
            fetched = self._load_from_storage(parent, token_ids, len(path), max_pages, rid)
            self._count_lookup("storage", max_pages - len(path), len(fetched))
            pages += fetched
        elif rid is not None:
            self._prefetches.pop(rid, None)
        return pages

    def insert(self, token_ids: list[int], pages: list[int]) -> None:
        self._drain_writes()
        self._new_cached = []
        super().insert(token_ids, pages)
        if self.policy.write_policy == "write_through":
            nodes = [n for n in self._new_cached if n.host_page < 0]
            self._backup(nodes, [n.page for n in nodes])
        self._new_cached = []

    def _on_cached(self, node: _Node) -> None:
        self._new_cached.append(node)

    def evict(self, num_pages: int) -> int:
        """Free up to num_pages device pages, least recently used device leaves first; they stay on the host."""
        self._drain_writes()
        victims, pages = [], []
        while len(victims) < num_pages:
            node = self._pop_lru_candidate()
            if node is None:
                break
            victims.append(node)
            pages.append(self._detach_page(node))
            self._push_candidate(node.parent)
        needs_host = [(n, p) for n, p in zip(victims, pages) if n.host_page < 0]
        unsaved = self._backup([n for n, _ in needs_host], [p for _, p in needs_host])
        self.allocator.free(pages)
        self.num_pages -= len(victims)
        for node in unsaved:
            self._drop(node)
        return len(victims)

    def reset(self) -> None:
        self._drain_writes()
        for node in list(self._nodes()):
            if node.page >= 0:
                self.allocator.free([self._detach_page(node)])
            if node.host_page >= 0:
                self._free_host(node.host_page)
        self.root.children.clear()
        self.num_pages = 0
        self._candidates.clear()
        self._prefetches.clear()

    def prefetch(self, rid: str, token_ids: list[int]) -> None:
        if self.storage is None:
            return
        entry = self._start_prefetch(token_ids, (len(token_ids) - 1) // self.page_size)
        if entry is not None:
            self._prefetches[rid] = entry
            while len(self._prefetches) > _MAX_PREFETCHES:
                self._prefetches.popitem(last=False)

    def wait_for_loads(self) -> None:
        if self._load_event is not None:
            torch.cuda.current_stream(self.device.buffer.device).wait_event(self._load_event)
            self._load_event = None

    def reset_hit_counts(self) -> None:
        super().reset_hit_counts()
        self.stats.reset_traffic()  # the tiers' traffic counters start over too (after the warm-up)

    def tier_stats(self) -> dict:
        self._drain_writes()
        self._count_copy_times()
        host = self.host.allocator  # held pages: by nodes, or freed while a storage write still reads them
        host_pages = host.capacity - host.num_free - len(self._deferred_free)  # no walk: stats are polled
        return {
            "hicache": self.stats.snapshot(),
            "hicache_host_cached_tokens": host_pages * self.page_size,
            "hicache_host_total_tokens": self.host_capacity_pages * self.page_size,
        }

    @property
    def host_capacity_pages(self) -> int:
        return self.host.allocator.capacity

    def close(self) -> None:
        self.wait_for_writes(timeout=30.0)
        for pool in (self._reader, self._writer):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        if self.storage is not None:
            self.storage.close()

    # ---- checks for tests and /get_server_info ---------------------------------------------------------------

    def wait_for_writes(self, timeout: float) -> bool:
        """Block until every queued storage write has finished; False on timeout."""
        _, pending = wait_futures(self._writes, timeout=timeout)
        self._drain_writes()
        return not pending

    def host_pool_is_consistent(self) -> bool:
        """Every host page is free, held by exactly one node, or waiting for its storage write."""
        self._drain_writes()
        held = [n.host_page for n in self._nodes() if n.host_page >= 0]
        owned = len(set(held)) == len(held) and not set(held) & self._deferred_free
        total = self.host.allocator.num_free + len(held) + len(self._deferred_free)
        return owned and total == self.host.allocator.capacity

    # ---- tier 2 ---------------------------------------------------------------------------------------------

    def _load_from_host(self, nodes: list[_Node]) -> list[int]:
        """Device pages for host-only nodes (a prefix of them when the device is short); the caller's references."""
        self._protected.update(id(n) for n in nodes)
        try:
            pages = self._alloc_device(len(nodes))
        finally:
            self._protected.clear()
        nodes = nodes[: len(pages)]
        if not pages:
            return []
        began = time.perf_counter()
        self._copy_in("host", [n.host_page for n in nodes], pages)
        for node, page in zip(nodes, pages):
            self._attach_page(node, page)
        self.num_pages += len(pages)
        self.allocator.incref(pages)
        self._count_load("host", len(pages), time.perf_counter() - began)
        return pages

    def _backup(self, nodes: list[_Node], device_pages: list[int]) -> list[_Node]:
        """Copy device pages of nodes to new host pages; returns the nodes the host had no room for. Host pages
        go to the nodes root side first along each chain (eviction frees leaves first), so they ascend along
        every prefix and a prefix loaded back is one run of host pages; when the host is short, the deepest
        nodes are the ones left out."""
        nodes, device_pages = _root_side_first(nodes, device_pages)
        host_pages = self._alloc_host(len(nodes))
        saved = nodes[: len(host_pages)]
        if not saved:
            return nodes
        if self._load_event is not None:  # a freed host page may still be read by a load in flight
            torch.cuda.current_stream(self.device.buffer.device).wait_event(self._load_event)
        self.host.save(self.device, device_pages[: len(saved)], host_pages)
        event = None
        if self._load_stream is not None:
            event = torch.cuda.Event()
            event.record()
        for node, page in zip(saved, host_pages):
            node.host_page = page
        self.stats.add("stored_bytes_total", "host", len(saved) * self.host.page_nbytes)
        if self.storage is not None:
            self._queue_writes([n for n in saved if not n.stored], event)
        return nodes[len(saved) :]

    def _alloc_device(self, n: int) -> list[int]:
        if self.allocator.num_free < n:
            self.evict(n - self.allocator.num_free)
        k = min(n, self.allocator.num_free)
        return self.allocator.alloc(k) if k else []

    def _alloc_host(self, n: int) -> list[int]:
        if self.host.allocator.num_free < n:
            self._evict_host(n - self.host.allocator.num_free)
        k = min(n, self.host.allocator.num_free)
        return self.host.allocator.alloc(k) if k else []

    def _evict_host(self, num_pages: int) -> None:
        """Drop host copies LRU-first: backups of device pages, and host-only leaves (their nodes leave the tree)."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if self._host_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, node = heapq.heappop(heap)
            self._free_host(node.host_page)
            node.host_page = -1
            freed += 1
            if node.page < 0:
                parent = node.parent
                del parent.children[node.key]
                if parent is not self.root and self._host_evictable(parent):
                    heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def _host_evictable(self, node: _Node) -> bool:
        return (node.host_page >= 0 and not self._busy[node.host_page] and id(node) not in self._protected
                and (node.page >= 0 or not node.children))

    def _free_host(self, host_page: int) -> None:
        if self._busy[host_page]:
            self._deferred_free.add(host_page)
        else:
            self.host.allocator.free([host_page])

    def _drop(self, node: _Node) -> None:
        """Remove a node no tier holds, with its subtree (held by the host only, if at all). Dropping a node
        inside a subtree dropped before frees nothing twice."""
        del node.parent.children[node.key]
        stack = [node]
        while stack:
            n = stack.pop()
            if n.host_page >= 0:
                self._free_host(n.host_page)
                n.host_page = -1
            stack.extend(n.children.values())

    def _copy_in(self, tier: str, host_pages: list[int], device_pages: list[int]) -> None:
        if self._load_stream is None:
            began = time.perf_counter()
            self.host.load(self.device, host_pages, device_pages)
            self.stats.add("load_copy_seconds_total", tier, time.perf_counter() - began)
            return
        self._load_stream.wait_stream(torch.cuda.current_stream(self.device.buffer.device))
        with torch.cuda.stream(self._load_stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.host.load(self.device, host_pages, device_pages)
            end.record()
        self._load_event = end
        self._timed_loads.append((tier, start, end))

    def _count_copy_times(self) -> None:
        """Device time of the loads whose copies have finished (CUDA), without waiting for the others."""
        pending = []
        for tier, start, end in self._timed_loads:
            if end.query():
                self.stats.add("load_copy_seconds_total", tier, start.elapsed_time(end) / 1e3)
            else:
                pending.append((tier, start, end))
        self._timed_loads = pending

    # ---- tier 3 ---------------------------------------------------------------------------------------------

    def _load_from_storage(self, parent: _Node, token_ids: list[int], start: int, max_pages: int,
                           rid: str | None) -> list[int]:
        blocks = self._take_prefetch(rid, token_ids, start, max_pages)
        if not blocks:
            return []
        host_pages = self._alloc_host(len(blocks))
        device_pages = self._alloc_device(len(host_pages))
        if len(device_pages) < len(host_pages):
            self.host.allocator.free(host_pages[len(device_pages) :])
            host_pages = host_pages[: len(device_pages)]
        began = time.perf_counter()
        node = parent
        for i, (host_page, (block_hash, payload)) in enumerate(zip(host_pages, blocks)):
            self.host.write_page(host_page, payload)
            key = tuple(token_ids[(start + i) * self.page_size : (start + i + 1) * self.page_size])
            child = _Node(page=-1, parent=node, key=key, last_access=next(_clock),
                          host_page=host_page, block_hash=block_hash, stored=True)
            node.children[key] = child
            self._attach_page(child, device_pages[i])
            node = child
        self._copy_in("storage", host_pages, device_pages)
        self.num_pages += len(device_pages)
        self.allocator.incref(device_pages)
        self._count_load("storage", len(device_pages), time.perf_counter() - began)
        return device_pages

    def _take_prefetch(self, rid: str | None, token_ids: list[int], start: int, max_pages: int) -> list:
        """Blocks for pages [start, max_pages) as far as storage has them, waiting as the prefetch policy says."""
        entry = self._prefetches.pop(rid, None) if rid is not None else None
        if entry is None or entry.start > start:
            entry = self._start_prefetch(token_ids, max_pages)
        if entry is None:
            return []
        try:
            blocks = entry.future.result(timeout=self._prefetch_wait(entry))
        except FutureTimeout:
            return []
        return blocks[start - entry.start : max_pages - entry.start]

    def _prefetch_wait(self, entry: _Prefetch) -> float:
        policy = self.policy
        if policy.prefetch_policy == "wait_complete":
            return policy.wait_complete_limit
        if policy.prefetch_policy == "timeout":
            return policy.prefetch_timeout_base + policy.prefetch_timeout_per_ki_token * entry.num_tokens / 1024
        return 0.0

    def _start_prefetch(self, token_ids: list[int], max_pages: int) -> _Prefetch | None:
        path = self._walk(token_ids, max_pages, touch=False)
        start = len(path)
        if start >= max_pages:
            return None
        ps = self.page_size
        parent_hash = self._hash_of(path[-1]) if path else self._root_hash
        keys = [token_ids[i * ps : (i + 1) * ps] for i in range(start, max_pages)]
        future = self._reader.submit(self._fetch_blocks, parent_hash, keys)
        return _Prefetch(start, len(keys) * ps, future)

    def _fetch_blocks(self, parent_hash: bytes, pages: list[list[int]]) -> list[tuple[bytes, bytes]]:
        """Reader thread: consecutive blocks from storage until the first miss; a bad block is removed."""
        blocks = []
        for block_hash in chain_hashes(parent_hash, pages):
            key = block_hash.hex()
            try:
                block = self.storage.get(key)
                if block is None:
                    break
                blocks.append((block_hash, decode_block(block, key, self.host.page_nbytes)))
            except BlockError as exc:
                logger.warning("hicache: %s; dropping it, the page is recomputed", exc)
                self.stats.add("corrupt_blocks_total", "storage", 1)
                self._remove_quietly(key)
                break
            except Exception as exc:  # noqa: BLE001 - any backend failure degrades to recompute
                self._backend_error("get", exc)
                break
        return blocks

    def _queue_writes(self, nodes: list[_Node], event) -> None:
        items = [(self._hash_of(n).hex(), n.host_page) for n in nodes]
        if not items:
            return
        for _, host_page in items:
            self._busy[host_page] += 1
        self._writes = [f for f in self._writes if not f.done()]
        self._writes.append(self._writer.submit(self._write_blocks, items, event))

    def _write_blocks(self, items: list[tuple[str, int]], event) -> None:
        """Writer thread: put host pages into storage (skipping keys already there), then release them."""
        if event is not None:
            event.synchronize()
        for key, host_page in items:
            try:
                if not self.storage.exists(key):
                    self.storage.put(key, encode_block(key, self.host.read_page(host_page)))
                    self.stats.add("stored_bytes_total", "storage", self.host.page_nbytes)
            except Exception as exc:  # noqa: BLE001 - any backend failure degrades to recompute
                self._backend_error("put", exc)
            finally:
                self._done.put(host_page)

    def _drain_writes(self) -> None:
        while True:
            try:
                host_page = self._done.get_nowait()
            except queue.Empty:
                return
            self._busy[host_page] -= 1
            if not self._busy[host_page]:
                del self._busy[host_page]
                if host_page in self._deferred_free:
                    self._deferred_free.discard(host_page)
                    self.host.allocator.free([host_page])

    def _backend_error(self, op: str, exc: Exception) -> None:
        self.stats.add("backend_errors_total", "storage", 1)
        logger.warning("hicache: storage %s failed (%s); the prefix is recomputed", op, exc)

    def _remove_quietly(self, key: str) -> None:
        try:
            self.storage.remove(key)
        except Exception as exc:  # noqa: BLE001
            self._backend_error("remove", exc)

    # ---- tree helpers ---------------------------------------------------------------------------------------

    def _hash_of(self, node: _Node) -> bytes:
        """Tier-3 hash of a node's page, computing the missing links of the chain from the nearest known one."""
        missing = []
        while node is not self.root and not node.block_hash:
            missing.append(node)
            node = node.parent
        parent = self._root_hash if node is self.root else node.block_hash
        missing.reverse()
        for n, h in zip(missing, chain_hashes(parent, [n.key for n in missing])):
            n.block_hash = h
        return missing[-1].block_hash if missing else parent

    def _count_lookup(self, tier: str, looked_up_pages: int, hit_pages: int) -> None:
        self.stats.add("hit_tokens_total", tier, hit_pages * self.page_size)
        self.stats.add("miss_tokens_total", tier, (looked_up_pages - hit_pages) * self.page_size)

    def _count_load(self, tier: str, num_pages: int, seconds: float) -> None:
        self.stats.add("loaded_bytes_total", tier, num_pages * self.host.page_nbytes)
        self.stats.add("load_seconds_total", tier, seconds)
        self.stats.add("loads_total", tier, 1)


def _root_side_first(nodes: list[_Node], pages: list[int]) -> tuple[list[_Node], list[int]]:
    """`nodes` (with their `pages`) in tree pre-order: every chain among them root side first."""
    page_of = {id(node): page for node, page in zip(nodes, pages)}
    ordered = []
    for node in nodes:
        if id(node.parent) in page_of:
            continue
        stack = [node]
        while stack:
            top = stack.pop()
            ordered.append(top)
            stack.extend(c for c in top.children.values() if id(c) in page_of)
    return ordered, [page_of[id(n)] for n in ordered]


def model_identity(model_path: str, layout: KVLayout, dummy_weights_seed: int | None = None) -> bytes:
    """What makes KV pages interchangeable: the model's config and weights (sampled; the seed of random
    weights with --load-format dummy) and the KV layout."""
    digest = hashlib.sha256(b"" if dummy_weights_seed is None else f"dummy-weights:{dummy_weights_seed}".encode())
    with open(os.path.join(model_path, "config.json"), "rb") as f:
        digest.update(f.read())
    for name in sorted(os.listdir(model_path)):
        if name.endswith(".safetensors"):
            path = os.path.join(model_path, name)
            with open(path, "rb") as f:
                digest.update(name.encode() + os.path.getsize(path).to_bytes(8, "little") + f.read(1 << 20))
    shape = {k: v for k, v in layout.describe().items() if k != "num_pages"}
    digest.update(json.dumps(shape, sort_keys=True).encode())
    return digest.digest()
