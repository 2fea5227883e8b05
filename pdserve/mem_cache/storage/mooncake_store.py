"""`mooncake` backend: Mooncake Store, the distributed KV object store of the mooncake wheels.

Configured by `--hicache-storage-backend-extra-config` (JSON): `master_server_address` (host:port of a running
`mooncake_master`) is required; `metadata_server` (default P2PHANDSHAKE), `local_hostname` (127.0.0.1),
`protocol` (tcp; rdma where present), `device_name` (RDMA devices), `global_segment_size` (bytes this client
contributes to the store, default 256 MiB) and `local_buffer_size` (default 64 MiB) have working defaults.
The client connects in a background thread; until it is up every lookup is a miss. The master's port is
probed first: the Mooncake client's setup retries for about 90 s against a dead master while holding the GIL,
which would stall the scheduler.
"""

from __future__ import annotations

import logging
import socket
import threading

from pdserve.mem_cache.storage.base import StorageBackend, StorageError

logger = logging.getLogger(__name__)

_PROBE_TIMEOUT = 3.0
_DEFAULTS = {
    "metadata_server": "P2PHANDSHAKE",
    "local_hostname": "127.0.0.1",
    "protocol": "tcp",
    "device_name": "",
    "global_segment_size": 256 << 20,
    "local_buffer_size": 64 << 20,
}


class MooncakeStorage(StorageBackend):
    name = "mooncake"

    def __init__(self, extra_config: dict):
        if not extra_config.get("master_server_address"):
            raise StorageError("the mooncake backend needs master_server_address in --hicache-storage-backend-extra-config")
        unknown = sorted(set(extra_config) - set(_DEFAULTS) - {"master_server_address"})
        if unknown:
            raise StorageError(f"unknown mooncake setting(s): {', '.join(unknown)}")
        self.config = {**_DEFAULTS, **extra_config}
        self._store = None
        self._failed: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._connect, name="hicache-mooncake-setup", daemon=True).start()

    def _connect(self) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            self._failed = f"mooncake is not installed ({exc})"
            return
        cfg = self.config
        host, _, port = cfg["master_server_address"].rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=_PROBE_TIMEOUT).close()
        except (OSError, ValueError) as exc:
            self._failed = f"cannot reach the Mooncake master at {cfg['master_server_address']} ({exc})"
            logger.warning("hicache: %s; storage lookups are misses", self._failed)
            return
        store = MooncakeDistributedStore()
        rc = store.setup({
            "local_hostname": cfg["local_hostname"], "metadata_server": cfg["metadata_server"],
            "global_segment_size": str(int(cfg["global_segment_size"])),
            "local_buffer_size": str(int(cfg["local_buffer_size"])), "protocol": cfg["protocol"],
            "rdma_devices": cfg["device_name"], "master_server_addr": cfg["master_server_address"],
        })
        if rc != 0:
            self._failed = f"cannot reach the Mooncake master at {cfg['master_server_address']} (setup returned {rc})"
            logger.warning("hicache: %s; storage lookups are misses", self._failed)
            return
        self._store = store
        self._ready.set()

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    def _client(self):
        if self._store is None:
            raise StorageError(self._failed or "the Mooncake client is still connecting")
        return self._store

    def exists(self, key: str) -> bool:
        if self._store is None:
            return False
        rc = self._store.is_exist(key)
        if rc < 0:
            raise StorageError(f"mooncake is_exist({key}) returned {rc}")
        return rc == 1

    def get(self, key: str) -> bytes | None:
        data = self._client().get(key)
        return bytes(data) if data else None

    def put(self, key: str, block: bytes) -> None:
        rc = self._client().put(key, block)
        if rc != 0:
            raise StorageError(f"mooncake put({key}) returned {rc}")

    def remove(self, key: str) -> None:
        if self._store is not None:
            self._store.remove(key)

    def close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store.close()
