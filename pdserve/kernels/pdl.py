"""Programmatic dependent launch (PDL, Hopper and later): a decode step's kernels are launched so that each may start
while the one before it finishes, instead of after it: its programs are placed, and its launch's own latency spent,
while the one before streams its last blocks. A decode step is some 300 short kernels one after another, and each
boundary costs the launch, the ramp-up and the first loads' latency.

Every kernel launched with PDL (`launch_options`) waits (`wait_for_previous`) until the kernel before it has
completed and its writes are visible, before it reads or writes memory that a kernel may write (it may read a
weight before: the FP8 rows kernel reads its first weight block so), and every program of it waits, so a kernel
completes only after the one before it: each kernel is ordered after all earlier ones, as plain stream order orders
them (a kernel launched without PDL, e.g. cuBLAS's, starts after the one before has completed, as always).
`launch_next` lets the next kernel launch: a short kernel calls it at once (`start_dependent`), one that streams a
weight or the KV cache only when its main loop is done. Called at once everywhere, it let every kernel launch the
next as soon as it was resident, and the GPU filled with waiting programs of the kernels ahead, placed wherever room
was left (H100, 2026-11-27: batch 1 TBT 3.83 -> 4.05 ms with FP8 weights, 6.04 -> 6.15 ms bf16). Graph capture keeps
the launches' dependency kind. PDSERVE_PDL=0 turns PDL off.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def pdl_enabled(device: torch.device) -> bool:
    """PDL on this device: a CUDA GPU of compute capability 9.0 or more, unless PDSERVE_PDL=0."""
    return device.type == "cuda" and os.environ.get("PDSERVE_PDL", "1") != "0" and _capability(device.index) >= (9, 0)


@lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def launch_options(device: torch.device) -> dict:
    """The PDL kernel constant and launch option of a launch on this device."""
    return dict(PDL=True, launch_pdl=True) if pdl_enabled(device) else dict(PDL=False)


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
