"""Programmatic dependent launch (PDL, Hopper and later): a decode step's kernels are launched so that each may start
while the one before it finishes, instead of after it, and do the work that needs nothing from it (an L2 prefetch
of its weight) in that time. A decode step is some 300 short kernels one after another, and each boundary costs the
launch, the ramp-up and the first loads' latency.

Every kernel launched with PDL (`launch_options`) begins with `start_dependent` (after any prefetch of data no
kernel writes): it lets the next kernel launch and waits until the kernel before it has completed and its writes
are visible. Every program of such a kernel waits before anything else, so a kernel completes only after the one
before it: the wait orders each kernel after all earlier ones, as plain stream order does. Before the wait a kernel
may only read what no kernel writes (weights) and write nothing. Graph capture keeps the launches' dependency kind.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

L2_LINE = 128  # bytes
L2_LINE_BITS = tl.constexpr(L2_LINE * 8)
PREFETCH_LINES = tl.constexpr(4)  # of each row, a loop iteration
PREFETCH_BUDGET = 16 << 20  # bytes of weight a launch prefetches into L2 at most, well inside an H100's 50 MB


def pdl_enabled(device: torch.device) -> bool:
    """PDL on this device: a CUDA GPU of compute capability 9.0 or more, unless PDSERVE_PDL=0."""
    return device.type == "cuda" and os.environ.get("PDSERVE_PDL", "1") != "0" and _capability(device.index) >= (9, 0)


@lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def launch_options(device: torch.device) -> dict:
    """The PDL kernel constant and launch option of a launch on this device."""
    return dict(PDL=True, launch_pdl=True) if pdl_enabled(device) else dict(PDL=False)


def prefetch_columns(programs: int, block_n: int, k_columns: int, element_size: int, device: torch.device) -> int:
    """Columns of each of its block_n weight rows a program prefetches before its wait (whole L2 lines, at most its
    K range of k_columns; 0 without PDL, where nothing runs before the loads) so that the grid's programs prefetch at
    most PREFETCH_BUDGET bytes together. A launch argument, not a kernel constant: one compiled kernel for all."""
    if not pdl_enabled(device):
        return 0
    row_bytes = min(k_columns * element_size, PREFETCH_BUDGET // (programs * block_n))
    return row_bytes // L2_LINE * L2_LINE // element_size


@triton.jit
def start_dependent(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the one before (no-op without PDL: plain stream order)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def prefetch_weight(W, offs_n, mask_n, stride_wn, k_start, k_end, prefetch_cols, PDL: tl.constexpr):
    """With PDL, prefetch into L2 columns [k_start, k_start + prefetch_cols) (up to k_end) of weight rows offs_n,
    fire and forget, PREFETCH_LINES lines of each row at a time; masked rows and columns prefetch W's first line."""
    if PDL:
        line: tl.constexpr = L2_LINE_BITS // W.dtype.element_ty.primitive_bitwidth  # elements
        offs = tl.arange(0, PREFETCH_LINES) * line
        for k0 in range(k_start, tl.minimum(k_start + prefetch_cols, k_end), PREFETCH_LINES * line):
            cols = k0 + offs
            ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + cols[None, :]
            ptrs = tl.where(mask_n[:, None] & (cols < k_end)[None, :], ptrs, W)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                      is_pure=False, pack=1)
