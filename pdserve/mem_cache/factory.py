"""Builds the prefix cache a scheduler asked for with its flags: the null cache, the radix cache, or the tiered one."""

from __future__ import annotations

import logging
import os

from pdserve.config import ServerArgs
from pdserve.mem_cache.hiradix_cache import HiCachePolicy, HiRadixCache, model_identity
from pdserve.mem_cache.host_pool import HostKVPool
from pdserve.mem_cache.kv_pool import KVPool, PageAllocator
from pdserve.mem_cache.null_cache import NullPrefixCache
from pdserve.mem_cache.radix_cache import RadixCache
from pdserve.mem_cache.stats import HiCacheStats
from pdserve.mem_cache.storage import StorageBackend, StorageError, create_storage

logger = logging.getLogger(__name__)

STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
_POLICY_KEYS = ("prefetch_timeout_base", "prefetch_timeout_per_ki_token")


def create_prefix_cache(args: ServerArgs, allocator: PageAllocator, pool: KVPool) -> RadixCache | NullPrefixCache:
    if args.disable_radix_cache:
        return NullPrefixCache()
    if not args.enable_hierarchical_cache:
        return RadixCache(allocator, args.page_size)
    extra = args.hicache_extra_config  # a fresh dict: the policy keys are popped from it
    policy = HiCachePolicy(
        write_policy=args.hicache_write_policy, prefetch_policy=args.hicache_storage_prefetch_policy,
        **{k: float(extra.pop(k)) for k in _POLICY_KEYS if k in extra},
    )
    host = HostKVPool(pool.layout, host_pages(args, pool), args.hicache_mem_layout, pin=pool.buffer.is_cuda)
    stats = HiCacheStats()
    storage = open_storage(args, extra, stats)
    logger.info("hierarchical cache: host tier %d pages (%.2f GB, %s), storage %s", host.allocator.capacity,
                host.nbytes / 1e9, args.hicache_mem_layout, storage.name if storage else "off")
    identity = model_identity(args.model_path, pool.layout, args.random_seed if args.load_format == "dummy" else None)
    return HiRadixCache(allocator, pool, host, storage, identity, policy, stats)


def host_pages(args: ServerArgs, pool: KVPool) -> int:
    """--hicache-size GB when given, else --hicache-ratio times the device pool; one page is reserved."""
    page_nbytes = 2 * pool.layout.num_layers * pool.layout.page_bytes
    if args.hicache_size > 0:
        pages = int(args.hicache_size * (1 << 30) // page_nbytes)
    else:
        pages = int((pool.layout.num_pages - 1) * args.hicache_ratio)
    return max(pages, 1) + 1


def open_storage(args: ServerArgs, extra: dict, stats: HiCacheStats) -> StorageBackend | None:
    """The tier-3 backend, or None (with a warning and a counted error) when it cannot be opened."""
    if not args.hicache_storage_backend:
        return None
    storage_dir = args.hicache_storage_dir or os.environ.get(STORAGE_DIR_ENV) or "/tmp/hicache"
    try:
        return create_storage(args.hicache_storage_backend, extra, storage_dir,
                              int(args.hicache_storage_size * (1 << 30)))
    except StorageError as exc:
        stats.add("backend_errors_total", "storage", 1)
        logger.warning("hicache: storage backend %s unavailable (%s); running without tier 3",
                       args.hicache_storage_backend, exc)
        return None
