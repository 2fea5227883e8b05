"""Compiling a Triton kernel for sm_90 on any machine (Triton's own ptxas, no GPU), for tests that read the PTX."""

from __future__ import annotations

import inspect
from importlib.util import find_spec
from pathlib import Path

import pytest

_triton = find_spec("triton")
# a Triton build without the CUDA backend's own ptxas cannot compile for sm_90; any other compile error fails
needs_ptxas = pytest.mark.skipif(
    _triton is None or not (Path(_triton.submodule_search_locations[0]) / "backends/nvidia/bin/ptxas").exists(),
    reason="Triton or its CUDA backend tools are not installed")


def compile_for_sm90(kernel, pointers: dict[str, str], constants: dict, floats: tuple[str, ...], aligned: list[str],
                     num_warps: int, num_stages: int):
    """`kernel` compiled for sm_90: `pointers` name -> pointer type, `constants` the constexprs, `floats` the fp32
    arguments (every other one i32), `aligned` the arguments specialized as multiples of 16 (as launched)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: pointers.get(n, "constexpr" if n in constants else "fp32" if n in floats else "i32")
                 for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))
