"""Tier-3 storage backends: `file` (a directory, local or shared) and `mooncake` (Mooncake Store)."""

from __future__ import annotations

from pdserve.mem_cache.storage.base import StorageBackend, StorageError


def create_storage(name: str, extra_config: dict, storage_dir: str, capacity_bytes: int) -> StorageBackend:
    if name == "file":
        from pdserve.mem_cache.storage.file import FileStorage

        return FileStorage(storage_dir, capacity_bytes)
    if name == "mooncake":
        from pdserve.mem_cache.storage.mooncake_store import MooncakeStorage

        return MooncakeStorage(extra_config)
    raise StorageError(f"unknown storage backend {name!r} (file or mooncake)")
