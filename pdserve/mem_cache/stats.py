"""Counters of the hierarchical KV cache. Free of torch: the HTTP server's /metrics imports the names."""

from __future__ import annotations

import threading

TIERS = ("device", "host", "storage")

METRIC_HELP = {
    "pdserve_hicache_hit_tokens_total": "Prompt tokens found in this KV-cache tier.",
    "pdserve_hicache_miss_tokens_total": "Prompt tokens looked up in this KV-cache tier and not found.",
    "pdserve_hicache_loaded_bytes_total": "KV bytes copied up to the device from this tier.",
    "pdserve_hicache_stored_bytes_total": "KV bytes written into this tier.",
    "pdserve_hicache_load_seconds_total": "Host seconds spent loading KV from this tier.",
    "pdserve_hicache_load_copy_seconds_total": "Seconds the copies of loads from this tier took on the device "
                                               "(CUDA events; the host time on CPU).",
    "pdserve_hicache_loads_total": "Loads of KV from this tier.",
    "pdserve_hicache_backend_errors_total": "Failed operations of this tier's backend (served by recompute).",
    "pdserve_hicache_corrupt_blocks_total": "Blocks of this tier dropped for a wrong key or checksum.",
}


TRAFFIC = tuple(name for name in METRIC_HELP if "errors" not in name and "corrupt" not in name)


class HiCacheStats:
    """Counters named like the Prometheus series they export to (METRIC_HELP), each keyed by tier. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.per_tier = {name: dict.fromkeys(TIERS, 0) for name in METRIC_HELP}

    def add(self, name: str, tier: str, value: float) -> None:
        with self._lock:
            self.per_tier[f"pdserve_hicache_{name}"][tier] += value

    def reset_traffic(self) -> None:
        """Hits, misses, bytes and loads start over (after the warm-up); backend errors seen so far are kept."""
        with self._lock:
            for name in TRAFFIC:
                self.per_tier[name] = dict.fromkeys(TIERS, 0)

    def snapshot(self) -> dict:
        with self._lock:
            return {name: dict(values) for name, values in self.per_tier.items()}
