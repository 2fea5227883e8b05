"""Tier 2: a KV pool in host memory (pinned when the device pool is on CUDA), with its own page allocator.

Both layouts store a page as `[2, layers, page_size * kv_heads * head_dim]` elements, arranged as
- `page_first` `[pages, 2, layers, X]`: each page is one contiguous block, so a run of consecutive host pages
  crosses the bus in one copy whatever its length, and a storage block is the page itself;
- `layer_first` `[2, layers, pages, X]`: like the device pool, one copy per K/V layer slice of a run.

A transfer of N pages never copies page by page: host pages are coalesced into runs of consecutive pages and
each run is copied (non_blocking, on the current stream) to or from a staging buffer on the device; one index
kernel then scatters the staged pages into the device pool (`index_copy_`) or gathers them from it
(`index_select`), wherever the device pages lie. Transfers larger than the staging buffer go in chunks; the
stream orders a chunk's copies after the previous chunk's kernel, so one buffer per direction is enough.
"""

from __future__ import annotations

from typing import Literal

import torch

from pdserve.mem_cache.kv_pool import KVLayout, KVPool, PageAllocator
from pdserve.mem_cache.kv_quant import copyable

MemLayout = Literal["layer_first", "page_first"]
MEM_LAYOUTS: tuple[MemLayout, ...] = ("page_first", "layer_first")
STAGING_BYTES = 64 << 20  # per direction; a chunk of this size keeps the copy engine near its peak


class HostKVPool:
    def __init__(self, device_layout: KVLayout, num_pages: int, mem_layout: MemLayout, pin: bool,
                 staging_bytes: int = STAGING_BYTES):
        lay = device_layout
        if mem_layout not in MEM_LAYOUTS:
            raise ValueError(f"unknown host memory layout {mem_layout!r}; expected one of {MEM_LAYOUTS}")
        self.page_size = lay.page_size
        self.mem_layout = mem_layout
        self.allocator = PageAllocator(num_pages)
        self.num_layers = lay.num_layers
        self.page_numel = lay.page_size * lay.num_kv_heads * lay.head_dim  # one layer's K (or V) of a page
        self.page_nbytes = 2 * lay.num_layers * lay.page_bytes
        self.buffer = torch.zeros(self._shape(num_pages), dtype=lay.dtype, pin_memory=pin)
        self.staging_pages = max(1, min(num_pages, staging_bytes // self.page_nbytes))
        self._staging: dict[str, torch.Tensor] = {}  # "load" / "save": device buffers made on first use

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def save(self, device: KVPool, device_pages: list[int], host_pages: list[int]) -> None:
        """Device pages → host pages, asynchronous on the current CUDA stream (the host pool is pinned there):
        per chunk one gather on the device, then one copy per host run (per K/V layer slice for layer_first)."""
        staging = self._staging_buffer(device, "save")
        for start in range(0, len(host_pages), self.staging_pages):
            hosts = host_pages[start : start + self.staging_pages]
            index = _device_index(device_pages[start : start + len(hosts)], staging.device)
            self._staged(staging, len(hosts)).copy_(_pages_view(device).index_select(2, index))
            for offset, first, count in _host_runs(hosts):
                for staged, host in self._run_slices(staging, offset, first, count):
                    host.copy_(staged, non_blocking=True)

    def load(self, device: KVPool, host_pages: list[int], device_pages: list[int]) -> None:
        """Host pages → device pages, asynchronous on the current CUDA stream: per chunk one copy per host run
        (per K/V layer slice for layer_first) into the staging buffer, then one scatter into the pool."""
        staging = self._staging_buffer(device, "load")
        for start in range(0, len(host_pages), self.staging_pages):
            hosts = host_pages[start : start + self.staging_pages]
            for offset, first, count in _host_runs(hosts):
                for staged, host in self._run_slices(staging, offset, first, count):
                    staged.copy_(host, non_blocking=True)
            index = _device_index(device_pages[start : start + len(hosts)], staging.device)
            copyable(_pages_view(device)).index_copy_(2, index, copyable(self._staged(staging, len(hosts))))

    def read_page(self, host_page: int) -> bytes:
        """One page as a storage block payload, `[2, layers, page_size, kv_heads, head_dim]`, in either layout."""
        return self._page(host_page).contiguous().view(torch.uint8).numpy().tobytes()

    def write_page(self, host_page: int, payload: bytes) -> None:
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.buffer.dtype)
        self._page(host_page).copy_(flat.view(2, self.num_layers, self.page_numel))

    def _shape(self, num_pages: int) -> tuple[int, ...]:
        if self.mem_layout == "page_first":
            return (num_pages, 2, self.num_layers, self.page_numel)
        return (2, self.num_layers, num_pages, self.page_numel)

    def _page(self, host_page: int) -> torch.Tensor:
        if self.mem_layout == "page_first":
            return self.buffer[host_page]
        return self.buffer[:, :, host_page]

    def _staging_buffer(self, device: KVPool, direction: str) -> torch.Tensor:
        staging = self._staging.get(direction)
        if staging is None:
            staging = torch.empty(self._shape(self.staging_pages), dtype=self.buffer.dtype,
                                  device=device.buffer.device)
            self._staging[direction] = staging
        return staging

    def _staged(self, staging: torch.Tensor, count: int) -> torch.Tensor:
        """The first `count` staged pages as `[2, layers, count, X]`, the device pool's page order."""
        if self.mem_layout == "page_first":
            return staging[:count].permute(1, 2, 0, 3)
        return staging[:, :, :count]

    def _run_slices(self, staging: torch.Tensor, offset: int, first: int, count: int):
        """(staging, host) pairs covering host pages [first, first+count) at staging pages [offset, ...),
        each pair contiguous on both sides: the whole run (page_first) or one K/V layer slice (layer_first)."""
        if self.mem_layout == "page_first":
            yield staging[offset : offset + count], self.buffer[first : first + count]
            return
        for kv in range(2):
            for layer in range(self.num_layers):
                yield (staging[kv, layer, offset : offset + count],
                       self.buffer[kv, layer, first : first + count])


def _pages_view(device: KVPool) -> torch.Tensor:
    """The device pool as `[2, layers, pages, page_size * kv_heads * head_dim]`."""
    buf = device.buffer
    return buf.view(2, buf.shape[1], device.layout.num_pages, -1)


def _device_index(pages: list[int], device: torch.device) -> torch.Tensor:
    index = torch.tensor(pages, dtype=torch.int64)
    if device.type == "cuda":  # from pinned memory the upload is asynchronous too
        return index.pin_memory().to(device, non_blocking=True)
    return index


def _host_runs(pages: list[int]):
    """(offset in `pages`, first page, count) over stretches of consecutive ascending pages."""
    i = 0
    while i < len(pages):
        n = 1
        while i + n < len(pages) and pages[i + n] == pages[i] + n:
            n += 1
        yield i, pages[i], n
        i += n
