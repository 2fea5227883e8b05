"""Prefix blocks the instances report holding (`GET /cache_report`), for the cache-aware policy.

The wire contract (the server's side is `pdserve/server/prefix_digest.py`): a report is
`{"block_chars": B, "device": [hex, ...], "host": [hex, ...]}`, each hex the 64-bit chained hash of one full
B-character block of a routing key (token ids: B ids in decimal, comma-joined): hash_k = blake2b-8(hash_{k-1} ‖
tag ‖ block_k), tag b"s" for text and b"i" for ids. One hash names the whole prefix up to its block, so the
longest block of the request's key found in a report is the longest prefix that instance holds.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b

MAX_BLOCK_CHARS = 1 << 16
_HEX64 = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True, slots=True)
class CacheReport:
    block_chars: int
    device: frozenset[int]
    host: frozenset[int]
    received_at: float  # monotonic time the router read it

    def longest(self, positions: dict[int, int]) -> tuple[int, str] | None:
        """(blocks, tier) of the longest prefix of a key this report holds, the device on a tie; `positions` maps
        each block hash of the key to the number of blocks up to and including it."""
        device = max((positions[h] for h in self.device.intersection(positions)), default=0)
        host = max((positions[h] for h in self.host.intersection(positions)), default=0)
        if not device and not host:
            return None
        return (device, "device") if device >= host else (host, "host")


def parse_cache_report(body: object, max_entries: int, received_at: float) -> CacheReport | None:
    """A `/cache_report` answer, or None when it is not one (or lists more than `max_entries` hashes)."""
    if not isinstance(body, dict):
        return None
    block, device, host = body.get("block_chars"), body.get("device"), body.get("host")
    if type(block) is not int or not 0 < block <= MAX_BLOCK_CHARS:
        return None
    if not isinstance(device, list) or not isinstance(host, list) or len(device) + len(host) > max_entries:
        return None
    tiers = [frozenset(int(h, 16) for h in hashes if isinstance(h, str) and _HEX64.fullmatch(h))
             for hashes in (device, host)]
    return CacheReport(block, tiers[0], tiers[1], received_at)


def key_block_hashes(key: str | Sequence, block: int) -> list[int]:
    """The contract's hash of each full block of the routing key."""
    text = isinstance(key, str)
    hashes, prev = [], b""
    for end in range(block, len(key) + 1, block):
        part = key[end - block : end]
        raw = part.encode("utf-8", "surrogatepass") if text else ",".join(str(t) for t in part).encode()
        prev = blake2b(prev + (b"s" if text else b"i") + raw, digest_size=8).digest()
        hashes.append(int.from_bytes(prev, "big"))
    return hashes


def longest_reported(reports: dict[str, CacheReport], key: str | Sequence) -> tuple[str, int, str] | None:
    """(url, prefix length matched in characters or ids, tier) of the instance reporting the longest prefix of
    `key`, the device tier first on a tie; None when no report holds any block of it."""
    best: tuple[int, bool, str, str] | None = None  # (matched, on the device, url, tier)
    positions_by_block: dict[int, dict[int, int]] = {}
    for url, report in reports.items():
        positions = positions_by_block.get(report.block_chars)
        if positions is None:
            hashes = key_block_hashes(key, report.block_chars)
            positions = positions_by_block[report.block_chars] = {h: n for n, h in enumerate(hashes, 1)}
        found = report.longest(positions)
        if found is not None:
            blocks, tier = found
            candidate = (blocks * report.block_chars, tier == "device", url, tier)
            if best is None or candidate[:2] > best[:2]:
                best = candidate
    return None if best is None else (best[2], best[0], best[3])
