"""What this instance's prefix cache holds, as the router's cache-aware policy can read it (`GET /cache_report`).

The router has no tokenizer, so both sides hash the request's routing key, never its tokens: the prompt text
(`/generate` `text`, `/v1/completions` `prompt`), a chat's messages (`role:content` of each, or its text parts,
joined), or the prompt's token ids when the client sent ids. The key is cut into blocks of `BLOCK_CHARS`
characters (ids: `BLOCK_CHARS` ids, written as decimal text, comma-joined); the hash of block k is the first 8
bytes of blake2b(hash of block k-1 ‖ tag ‖ block k), tag b"s" for text and b"i" for ids, so one hash names the
whole prefix up to the end of its block. Only full blocks count. `router/pdserve_router/reported_cache.py` is the
router's side of this contract.

The digest remembers the blocks of the prompts this instance has prefilled, most recently used first, deepest
blocks of a prompt older than its first ones (the radix cache evicts leaves first). A report splits them by the
instance's own capacity: the newest blocks whose tokens fit the device pool are `device`, the next ones up to the
host tier's capacity `host`, the rest are left out. It is the radix cache's LRU replayed on the text the router
sees, not a walk of the tree: no tokenizer on the router, no work on the scheduler thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from hashlib import blake2b

BLOCK_CHARS = 64
MAX_BLOCKS = 8192  # blocks remembered (a report lists at most this many hashes, 17 bytes each in JSON)


def block_hashes(key: str | Sequence[int], block: int) -> list[int]:
    """The chained hash of each full block of `key` (see the module docstring: the wire contract)."""
    tag, digest, out = (b"s" if isinstance(key, str) else b"i"), b"", []
    for start in range(0, len(key) - block + 1, block):
        chunk = key[start : start + block]
        data = chunk.encode("utf-8", "surrogatepass") if isinstance(chunk, str) else ",".join(map(str, chunk)).encode()
        digest = blake2b(digest + tag + data, digest_size=8).digest()
        out.append(int.from_bytes(digest, "big"))
    return out


def chat_routing_key(messages: Sequence) -> str:
    """A chat's routing key: each message's `role:content`, or the text of its parts, joined."""
    return "".join(_message_key(m) for m in messages)


def _message_key(message) -> str:
    if isinstance(message.content, list):
        return "".join(part.text for part in message.content)
    return f"{message.role}:{message.content}" if isinstance(message.content, str) else ""


class PrefixDigest:
    """Block hashes of prefilled prompts, LRU, each with the prompt tokens it stands for."""

    def __init__(self, enabled: bool, block: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS):
        self.enabled, self.block, self.max_blocks = enabled, block, max_blocks
        self.blocks: OrderedDict[int, float] = OrderedDict()

    def record(self, key: str | Sequence[int] | None, num_tokens: int) -> None:
        """A prompt of `num_tokens` tokens whose KV the prefix cache now holds."""
        if not self.enabled or not key:
            return
        tokens_per_block = num_tokens * self.block / len(key)
        for h in reversed(block_hashes(key, self.block)):  # the first block ends up the most recent
            self.blocks[h] = tokens_per_block
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)

    def clear(self) -> None:
        self.blocks.clear()

    def report(self, device_tokens: int, host_tokens: int) -> dict:
        tiers: dict[str, list[str]] = {"device": [], "host": []}
        used = 0.0
        for h, tokens in reversed(self.blocks.items()):
            used += tokens
            if used > device_tokens + host_tokens:
                break
            tiers["device" if used <= device_tokens else "host"].append(f"{h:016x}")
        return {"block_chars": self.block, **tiers}
