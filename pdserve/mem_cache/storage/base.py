"""Tier 3: KV page blocks in storage shared by instances, behind one small interface.

A block is one KV page of every layer (K and V). Its key is a hash chain: the key of page i hashes the key of
page i-1, the model/KV-layout identity and the page's token ids, so any instance serving the same model with
the same KV layout finds a prefix another instance stored. Every stored block carries its key and a checksum of
its payload; `decode_block` refuses a block whose key, length or checksum is wrong.
"""

from __future__ import annotations

import hashlib
import struct
from abc import ABC, abstractmethod
from array import array
from collections.abc import Iterable, Sequence

import msgpack

_MAGIC = b"PDKV\x01"
_HEADER_LEN = struct.Struct("<I")


class StorageError(RuntimeError):
    """A backend operation failed (unreachable service, I/O error): the caller treats it as a miss."""


class BlockError(ValueError):
    """A stored block is damaged or belongs to another key: it is dropped and its page recomputed."""


class StorageBackend(ABC):
    name: str

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The stored block, or None when the key is absent."""

    @abstractmethod
    def put(self, key: str, block: bytes) -> None: ...

    @abstractmethod
    def remove(self, key: str) -> None: ...

    def close(self) -> None:
        """Release connections and files."""


def root_hash(identity: bytes) -> bytes:
    return hashlib.sha256(b"pdserve-kv-root" + identity).digest()


def chain_hashes(parent: bytes, pages: Iterable[Sequence[int]]) -> list[bytes]:
    """Hash of each page given the hash of the page before the first one (root_hash for page 0)."""
    hashes = []
    for tokens in pages:
        parent = hashlib.sha256(parent + array("q", tokens).tobytes()).digest()
        hashes.append(parent)
    return hashes


def encode_block(key: str, payload: bytes) -> bytes:
    header = msgpack.packb({"key": key, "nbytes": len(payload), "sha256": hashlib.sha256(payload).digest()})
    return b"".join((_MAGIC, _HEADER_LEN.pack(len(header)), header, payload))


def decode_block(block: bytes, key: str, nbytes: int) -> bytes:
    """The payload of a block stored under `key`, checked against its header; BlockError if anything is off."""
    fixed = len(_MAGIC) + _HEADER_LEN.size
    if len(block) < fixed or not block.startswith(_MAGIC):
        raise BlockError(f"block {key}: not a pdserve KV block")
    (header_len,) = _HEADER_LEN.unpack_from(block, len(_MAGIC))
    if fixed + header_len > len(block):
        raise BlockError(f"block {key}: truncated header")
    try:
        header = msgpack.unpackb(block[fixed : fixed + header_len])
    except (ValueError, msgpack.UnpackException) as exc:
        raise BlockError(f"block {key}: unreadable header ({exc})") from exc
    payload = block[fixed + header_len :]
    if not isinstance(header, dict) or header.get("key") != key:
        raise BlockError(f"block {key}: stored under another key")
    if header.get("nbytes") != nbytes or len(payload) != nbytes:
        raise BlockError(f"block {key}: {len(payload)} payload bytes, expected {nbytes}")
    if header.get("sha256") != hashlib.sha256(payload).digest():
        raise BlockError(f"block {key}: checksum mismatch")
    return payload
