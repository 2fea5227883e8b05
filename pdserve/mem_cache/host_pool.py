"""Tier 2: a KV pool in host memory (pinned when the device pool is on CUDA), with its own page allocator.

`layer_first` mirrors the device layout, `[2, layers, slots, kv_heads, head_dim]`; `page_first` keeps each
page's K and V of every layer contiguous, `[pages, 2, layers, page_size, kv_heads, head_dim]`, so one page is
one contiguous block for storage I/O and one copy across the bus per run. Copies between the pools move
runs of consecutive pages at once.
"""

from __future__ import annotations

from typing import Literal

import torch

from pdserve.mem_cache.kv_pool import KVLayout, KVPool, PageAllocator

MemLayout = Literal["layer_first", "page_first"]


class HostKVPool:
    def __init__(self, device_layout: KVLayout, num_pages: int, mem_layout: MemLayout, pin: bool):
        lay = device_layout
        self.page_size = lay.page_size
        self.mem_layout = mem_layout
        self.allocator = PageAllocator(num_pages)
        if mem_layout == "page_first":
            shape = (num_pages, 2, lay.num_layers, lay.page_size, lay.num_kv_heads, lay.head_dim)
        else:
            shape = (2, lay.num_layers, num_pages * lay.page_size, lay.num_kv_heads, lay.head_dim)
        self.buffer = torch.zeros(shape, dtype=lay.dtype, pin_memory=pin)
        self.page_shape = (2, lay.num_layers, lay.page_size, lay.num_kv_heads, lay.head_dim)
        self.page_nbytes = 2 * lay.num_layers * lay.page_bytes

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def _page_view(self, pool_buffer: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """Pages [first, first+count) of a layer-first buffer as [count, 2, layers, page_size, heads, dim]."""
        ps = self.page_size
        run = pool_buffer[:, :, first * ps : (first + count) * ps]
        return run.unflatten(2, (count, ps)).permute(2, 0, 1, 3, 4, 5)

    def _host_run(self, first: int, count: int) -> torch.Tensor:
        if self.mem_layout == "page_first":
            return self.buffer[first : first + count]
        return self._page_view(self.buffer, first, count)

    def _layer_slices(self, device: KVPool, dev: int, host: int, count: int):
        """(host, device) slices of one K or V layer over a page run: contiguous on both sides (layer_first)."""
        ps = self.page_size
        for kv in range(2):
            for layer in range(self.page_shape[1]):
                yield (self.buffer[kv, layer, host * ps : (host + count) * ps],
                       device.buffer[kv, layer, dev * ps : (dev + count) * ps])

    def save(self, device: KVPool, device_pages: list[int], host_pages: list[int]) -> None:
        """Device pages → host pages, asynchronous on the current CUDA stream (the host pool is pinned there).

        Every copy across the bus is contiguous: per K/V layer slice (layer_first), or the whole run gathered
        into one device buffer first (page_first)."""
        for dev, host, n in _runs(device_pages, host_pages):
            if self.mem_layout == "page_first":
                self.buffer[host : host + n].copy_(self._page_view(device.buffer, dev, n).contiguous(), non_blocking=True)
                continue
            for host_slice, device_slice in self._layer_slices(device, dev, host, n):
                host_slice.copy_(device_slice, non_blocking=True)

    def load(self, device: KVPool, host_pages: list[int], device_pages: list[int]) -> None:
        """Host pages → device pages, asynchronous on the current CUDA stream."""
        for host, dev, n in _runs(host_pages, device_pages):
            if self.mem_layout == "page_first":
                staged = self.buffer[host : host + n].to(device.buffer.device, non_blocking=True)
                self._page_view(device.buffer, dev, n).copy_(staged)
                continue
            for host_slice, device_slice in self._layer_slices(device, dev, host, n):
                device_slice.copy_(host_slice, non_blocking=True)

    def read_page(self, host_page: int) -> bytes:
        page = self._host_run(host_page, 1).contiguous()
        return page.view(torch.uint8).numpy().tobytes()

    def write_page(self, host_page: int, payload: bytes) -> None:
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self._host_run(host_page, 1).copy_(flat.view(self.buffer.dtype).view(1, *self.page_shape))


def _runs(src: list[int], dst: list[int]):
    """(src_first, dst_first, count) over stretches where both page lists ascend by one."""
    i = 0
    while i < len(src):
        n = 1
        while i + n < len(src) and src[i + n] == src[i] + n and dst[i + n] == dst[i] + n:
            n += 1
        yield src[i], dst[i], n
        i += n
