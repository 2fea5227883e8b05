"""Compiling pdserve's Triton kernels for sm_90 on any machine (Triton's own ptxas, no GPU), to check their PTX."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
# a Triton build without the CUDA backend's own ptxas cannot compile for sm_90; any other compile error fails
needs_ptxas = pytest.mark.skipif(not (Path(triton.__path__[0]) / "backends/nvidia/bin/ptxas").exists(),
                                 reason="Triton's CUDA backend tools are not installed")


def compile_for_sm90(kernel, pointers: dict[str, str], constants: dict, floats: tuple[str, ...] = (),
                     unaligned: tuple[str, ...] = (), num_warps: int = 4, num_stages: int = 2):
    """kernel compiled for an H100: pointers maps each pointer parameter to its Triton type ("*bf16"), constants
    the constexprs; floats are the fp32 scalars, every other parameter an i32. Pointers and strides (but those named
    in unaligned) are 16-aligned, as launched."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: pointers.get(n, "constexpr" if n in constants else "fp32" if n in floats else "i32")
                 for n in names}
    aligned = [n for n in names if n not in unaligned and (n in pointers or n.startswith("stride"))]
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))
