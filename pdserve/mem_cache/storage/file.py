"""`file` backend: one file per block in a directory on local disk or a shared mount (NFS, Ceph, Lustre).

Writes go to a uniquely named temporary file that is renamed into place, so readers in any process see a
whole block or none, and several writers of the same key leave one whole copy. A read refreshes the block's
mtime; past the size bound the oldest blocks (by mtime) are removed until 90% of the bound is left.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

from pdserve.mem_cache.storage.base import StorageBackend, StorageError

_SUFFIX = ".kvblock"
_STALE_TEMP_SECONDS = 600.0


class FileStorage(StorageBackend):
    name = "file"

    def __init__(self, root: str, capacity_bytes: int = 0):
        """capacity_bytes 0: unbounded."""
        self.root = os.path.abspath(root)
        self.capacity_bytes = capacity_bytes
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create the storage directory {self.root}: {exc}") from exc
        self._lock = threading.Lock()
        self._used = self._scan_usage() if capacity_bytes else 0

    def _path(self, key: str) -> str:
        if not key.isalnum():
            raise StorageError(f"bad block key {key!r}")
        return os.path.join(self.root, key[:2], key + _SUFFIX)

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
            os.utime(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageError(f"reading {path}: {exc}") from exc
        return data

    def put(self, key: str, block: bytes) -> None:
        path = self._path(key)
        temp = f"{path}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(temp, "wb") as f:
                f.write(block)
            os.replace(temp, path)
        except OSError as exc:
            _unlink(temp)
            raise StorageError(f"writing {path}: {exc}") from exc
        if self.capacity_bytes:
            self._account(len(block))

    def remove(self, key: str) -> None:
        _unlink(self._path(key))

    def _account(self, nbytes: int) -> None:
        with self._lock:
            self._used += nbytes
            if self._used <= self.capacity_bytes:
                return
            self._used = self._evict_to(int(self.capacity_bytes * 0.9))

    def _evict_to(self, target: int) -> int:
        """Remove least recently used blocks (every process's, found by a directory scan) down to target bytes."""
        blocks = sorted(self._blocks(), key=lambda e: e[1])
        used = sum(size for _, _, size in blocks)
        for path, _, size in blocks:
            if used <= target:
                break
            _unlink(path)
            used -= size
        return used

    def _scan_usage(self) -> int:
        return sum(size for _, _, size in self._blocks())

    def _blocks(self):
        """(path, mtime, size) of every block; temporary files a crashed writer left behind are removed."""
        now = time.time()
        for sub in _scandir(self.root):
            if not sub.is_dir():
                continue
            for entry in _scandir(sub.path):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if entry.name.endswith(_SUFFIX):
                    yield entry.path, st.st_mtime, st.st_size
                elif entry.name.endswith(".tmp") and now - st.st_mtime > _STALE_TEMP_SECONDS:
                    _unlink(entry.path)


def _scandir(path: str):
    try:
        return list(os.scandir(path))
    except FileNotFoundError:
        return []


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
