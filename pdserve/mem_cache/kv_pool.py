"""Paged KV cache: one contiguous tensor holding every layer's K and V, and a page allocator.

Layout: `buffer[2, num_layers, num_slots, num_kv_heads, head_dim]`, `num_slots = num_pages * page_size`.
Page `p` covers slots `[p * page_size, (p + 1) * page_size)`. Each layer's K (and V) is contiguous, so a
transfer engine registers the whole buffer once and addresses a page run of one layer by byte offset.
Page 0 is never handed out: padded slots of CUDA-graph batches write there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    dtype: torch.dtype

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one layer's K (or V)."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's K (or V)."""
        return self.page_size * self.token_bytes

    @property
    def layer_bytes(self) -> int:
        return self.num_slots * self.token_bytes

    def region_offset(self, kv: int, layer: int) -> int:
        """Byte offset of layer `layer`'s K (kv=0) or V (kv=1) inside the buffer."""
        return (kv * self.num_layers + layer) * self.layer_bytes

    def describe(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "page_size": self.page_size,
            "num_pages": self.num_pages,
            "dtype": str(self.dtype).removeprefix("torch."),
        }


class KVPool:
    def __init__(self, layout: KVLayout, device: torch.device | str):
        self.layout = layout
        shape = (2, layout.num_layers, layout.num_slots, layout.num_kv_heads, layout.head_dim)
        self.buffer = torch.zeros(shape, dtype=layout.dtype, device=device)

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self.buffer[0, layer]

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self.buffer[1, layer]

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.buffer[0, layer].index_copy_(0, loc, k.to(self.layout.dtype))
        self.buffer[1, layer].index_copy_(0, loc, v.to(self.layout.dtype))

    @property
    def data_ptr(self) -> int:
        return self.buffer.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class PageAllocator:
    """Free list plus reference counts. Pages 1..num_pages-1 are allocatable; page 0 is reserved.

    The free list is a stack kept so that allocations come out as ascending contiguous runs where possible:
    a KV transfer then coalesces a request's pages into few large copies.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"need at least 2 pages (one is reserved), got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._refs = [0] * num_pages
        self._cached = bytearray(num_pages)  # the prefix cache holds one reference to the page
        self.num_cache_only = 0  # cached pages that nobody else references: what eviction could free now
        self.on_cache_only: Callable[[int], None] | None = None  # a cached page's other references just ended

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        pages = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"incref of free page {p}"
            self._refs[p] += 1
            if self._refs[p] == 2 and self._cached[p]:
                self.num_cache_only -= 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference of each page; pages that reach zero return to the free list."""
        released, cache_only = [], []
        for p in pages:
            assert self._refs[p] > 0, f"double free of page {p}"
            self._refs[p] -= 1
            if self._refs[p] == 0:
                released.append(p)
            elif self._refs[p] == 1 and self._cached[p]:
                cache_only.append(p)
        self._free.extend(reversed(released))  # the next alloc hands them out again in ascending runs
        self.num_cache_only += len(cache_only)
        if self.on_cache_only is not None:
            for p in cache_only:
                self.on_cache_only(p)

    def mark_cached(self, page: int) -> None:
        """The prefix cache has taken its reference to `page` (one of the page's references is now its own)."""
        assert self._refs[page] > 0 and not self._cached[page], f"page {page} cannot become cached"
        self._cached[page] = 1
        self.num_cache_only += self._refs[page] == 1

    def unmark_cached(self, page: int) -> None:
        """The prefix cache is about to drop its reference to `page`."""
        assert self._cached[page], f"page {page} is not cached"
        self._cached[page] = 0
        self.num_cache_only -= self._refs[page] == 1

    def refcount(self, page: int) -> int:
        return self._refs[page]
