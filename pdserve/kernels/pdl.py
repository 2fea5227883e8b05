"""Programmatic dependent launch (Hopper and later) for the Triton kernels of a decode step.

A kernel launched with it may start while the kernel before it on the stream is still running: its programs are
placed on the SMs as the earlier kernel's leave, and what they do before `wait_for_inputs` (a projection kernel
prefetches its first weight bytes into L2, `prefetch_weight_rows`) overlaps the earlier kernel's tail; at batch 1
a decode step is ~330 short kernels, each otherwise paying its launch and its ramp to full memory bandwidth.

The invariant, enforced by `wait_for_inputs` being the first thing every program of such a kernel does (before any
early return): nothing written by an earlier kernel is read, and nothing is written, before the wait. The wait
returns when the previous kernel has finished and its writes are visible; since that kernel's programs all waited
for the one before it, every earlier kernel has finished too. Right after the wait a program lets the next kernel
launch, so at most one kernel runs ahead, except after a short kernel (norms, rotary, the decode reduce, SiLU)
that lets the next launch before its own wait (`releases_first`): the projection kernel after it then prefetches
while the kernel before the short one still runs. A kernel releasing first keeps the invariant: its dependent still
waits for it to finish, and it finishes only after its own wait. Graph capture keeps these edges (CUDA 12.3+). Off
on other devices, in Triton's interpreter, and with PDSERVE_PDL=0.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PREFETCH_BYTES = 8 << 20  # weight bytes a projection kernel asks into L2 before its wait (H100/H200 L2: 50 MB)


OFF, RELEASE_AFTER_WAIT, RELEASE_FIRST = 0, 1, 2  # the kernels' PDL constexpr


@lru_cache(maxsize=None)
def _mode(index: int) -> str:
    if torch.cuda.get_device_capability(index) < (9, 0):
        return "0"
    return os.environ.get("PDSERVE_PDL", "1")


def pdl_options(device: torch.device, releases_first: bool = False) -> dict:
    """Keyword arguments for a Triton launch of a kernel taking the `PDL` constexpr: its value, and Triton's
    `launch_pdl` option where the device has programmatic dependent launch. releases_first: a short kernel that
    lets the next kernel launch before its own wait (see the module's docstring)."""
    mode = _mode(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else "0"
    if mode == "0":
        return {"PDL": OFF}
    early = releases_first and mode != "late"
    return {"PDL": RELEASE_FIRST if early else RELEASE_AFTER_WAIT, "launch_pdl": True}


def prefetch_row_bytes(rows: int, row_bytes: int, pdl: int) -> int:
    """Bytes from the start of each of `rows` weight rows (each `row_bytes` long) to prefetch before the wait:
    PREFETCH_BYTES spread over the rows, a multiple of 16 (the bulk prefetch's unit); 0 without PDL."""
    if not pdl:
        return 0
    return min(row_bytes, max(16, PREFETCH_BYTES // rows)) // 16 * 16


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Waits until the previous kernel on the stream has finished and its writes are visible, and lets the next
    kernel launch (after the wait, or before it for RELEASE_FIRST). Every program of a PDL kernel calls this before
    reading or writing anything but constants."""
    if PDL == 2:  # RELEASE_FIRST
        gdc_launch_dependents()
        gdc_wait()
    elif PDL == 1:  # RELEASE_AFTER_WAIT
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_weight_rows(row_ptrs, num_bytes, PDL: tl.constexpr):
    """Asks L2 for num_bytes (a multiple of 16, > 0) from each 16-byte aligned address in row_ptrs (a program's
    weight rows at its first K offset): one bulk prefetch each, no registers held, nothing waited for."""
    if PDL:
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // dummy $0", "=r,l,r",
                                  [row_ptrs, tl.full(row_ptrs.shape, num_bytes, tl.int32)], dtype=tl.int32,
                                  is_pure=False, pack=1)
