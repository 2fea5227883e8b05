"""The FP8 rows kernel asks L2 for the next weight once its own is read: compiled for sm_90 on any machine (Triton's
own ptxas, no GPU), the prefetches come after the main loop's weight loads and only where the launch has lanes for
them (a GPU); what is asked for is the next weight's first bytes, up to the budget."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from pdserve.kernels import l2_prefetch

triton = pytest.importorskip("triton")
needs_ptxas = pytest.mark.skipif(not (Path(triton.__path__[0]) / "backends/nvidia/bin/ptxas").exists(),
                                 reason="Triton's CUDA backend tools are not installed")

ROWS_KERNEL = dict(FP8_MAX=448.0, INV_FP8_MAX=1 / 448, MIN_SCALE=1e-12, QUANTIZE=True, STATIC=False, HW_CAST=True,
                   ROWS=16, BLOCK_N=64, BLOCK_K=256, HAS_BIAS=False, EVEN_K=True, PROMOTE_K=32, SPLIT_K=4,
                   AMAX_BLOCK=4096)


def compile_rows_kernel_for_sm90(prefetch_lanes: int) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pdserve.quantization.fp8_triton import fp8_rows_kernel

    names = list(inspect.signature(fp8_rows_kernel.fn).parameters)
    constants = dict(ROWS_KERNEL, PREFETCH_LANES=prefetch_lanes)
    pointers = dict(X="*bf16", XScale="*fp32", W="*fp8e4nv", WScale="*fp32", StaticScale="*fp32", B="*fp32",
                    Out="*bf16", Partial="*fp32", Counters="*i32", Next="*u8")
    signature = {n: pointers.get(n, "constexpr" if n in constants else "i32") for n in names}
    aligned = [n for n in names if n in pointers or n in ("K", "K_SPLIT", "stride_xm", "stride_wn", "stride_om")]
    source = ASTSource(fn=fp8_rows_kernel, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=4)).asm["ptx"]


@needs_ptxas
def test_the_rows_kernel_prefetches_after_its_weight_loads_on_a_gpu():
    with_lanes, without = compile_rows_kernel_for_sm90(128), compile_rows_kernel_for_sm90(0)
    assert "prefetch.global.L2" not in without
    assert "prefetch.global.L2" in with_lanes
    # the weight blocks stream by asynchronous copies; every prefetch is issued after the last of them
    assert with_lanes.rindex("cp.async.cg.shared.global") < with_lanes.index("prefetch.global.L2")


def test_prefetch_target_is_the_first_bytes_up_to_the_budget():
    small = torch.zeros(3, 40, dtype=torch.bfloat16)
    flat, count = l2_prefetch.prefetch_target(small)
    assert flat.dtype == torch.uint8 and flat.data_ptr() == small.data_ptr() and count == 240
    big = torch.empty(l2_prefetch.DEFAULT_PREFETCH_BYTES + 1000, dtype=torch.uint8)
    assert l2_prefetch.prefetch_target(big)[1] == l2_prefetch.DEFAULT_PREFETCH_BYTES
    assert l2_prefetch.prefetch_target(None) == (None, 0)


def test_disable_weight_prefetch_asks_for_nothing(tiny_models):
    from pdserve.config import ServerArgs
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.models.model_config import ModelConfig

    path = tiny_models["llama-tiny"]
    weight = torch.zeros(64, 64, dtype=torch.bfloat16)
    try:
        l2_prefetch.set_prefetch_budget(1000)
        assert l2_prefetch.prefetch_target(weight)[1] == 1000
        ModelRunner(ServerArgs(model_path=path, device="cpu", max_total_tokens=64, disable_weight_prefetch=True),
                    ModelConfig.from_path(path))
        assert l2_prefetch.prefetch_target(weight) == (None, 0)
    finally:
        l2_prefetch.set_prefetch_budget(l2_prefetch.DEFAULT_PREFETCH_BYTES)
