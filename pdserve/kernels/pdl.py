"""Programmatic dependent launch (PDL, Hopper and later): a decode step's kernels are launched so that each may start
while the one before it finishes, instead of after it, and do the work that needs nothing from it (an L2 prefetch
of its weight) in that time. A decode step is some 300 short kernels one after another, and each boundary costs the
launch, the ramp-up and the first loads' latency.

Every kernel launched with PDL (`launch_options`) waits (`wait_for_previous`) until the kernel before it has
completed and its writes are visible, before it reads or writes anything another kernel touches (it may prefetch a
weight first), and every program of it waits, so a kernel completes only after the one before it: each kernel is
ordered after all earlier ones, as plain stream order orders them. `launch_next` lets the next kernel launch: a
short kernel calls it at once (`start_dependent`), one that streams a weight or the KV cache only when its main
loop is done. Called at once everywhere, it let every kernel launch the next as soon as it was resident, and the
GPU filled with waiting programs of the kernels ahead, placed wherever room was left (H100, 2026-11-27: batch 1
TBT 3.83 -> 4.05 ms with FP8 weights, 6.04 -> 6.15 ms bf16). Graph capture keeps the launches' dependency kind.
PDSERVE_PDL=0 turns PDL off; PDSERVE_PDL_PREFETCH_MB sets PREFETCH_BUDGET (0: no prefetch).
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
PREFETCH_BUDGET = int(os.environ.get("PDSERVE_PDL_PREFETCH_MB", "16")) << 20  # bytes a launch prefetches at most,
# well inside an H100's 50 MB of L2


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
def wait_for_previous(PDL: tl.constexpr):
    """Wait until the kernel before has completed, its writes visible (no-op without PDL: plain stream order)."""
    if PDL:
        gdc_wait()


@triton.jit
def launch_next(PDL: tl.constexpr):
    """Let the next kernel launch once every program of this one has called this or exited."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def start_dependent(PDL: tl.constexpr):
    """A short kernel's start: let the next kernel launch, then wait for the one before."""
    launch_next(PDL)
    wait_for_previous(PDL)


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
