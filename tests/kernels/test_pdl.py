"""Programmatic dependent launch: every kernel of a decode step, compiled for sm_90 with PDL, lets the next kernel
launch and waits for the one before it before it touches memory (the rows kernels prefetch their weight into L2
first, and only that); without PDL nothing of it is compiled in. Which launches use it, and how much a launch
prefetches."""

from __future__ import annotations

import pytest
import torch

from kernels.sm90 import compile_for_sm90, needs_ptxas

from pdserve.kernels import pdl

FP8_CONSTANTS = dict(FP8_MAX=448.0, INV_FP8_MAX=1 / 448, MIN_SCALE=1e-12, STATIC=False, HW_CAST=True)


def _kernels():
    from pdserve.kernels import attention, fused, skinny_triton
    from pdserve.quantization import fp8_triton

    quant = dict(QScale="*fp32", StaticScale="*fp32")
    return {
        "decode": (attention._decode_split_kernel,
                   dict(Q="*bf16", K="*fp8e4nv", V="*i32", PageTable="*i32", SeqLens="*i32", Out="*bf16",
                        PartialO="*fp32", PartialLse="*fp32", Counters="*i32"),
                   dict(GROUP=4, BLOCK_H=16, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=64, MAX_SPLITS=4, MIN_SPLIT_LEN=256,
                        FP16_DOTS=True, V_WORDS=True), ("sm_scale_log2", "v_scale")),
        "rmsnorm": (fused._rmsnorm_kernel,
                    dict(X="*bf16", Res="*bf16", W="*bf16", Out="*fp8e4nv", ResOut="*bf16", **quant),
                    dict(N=4096, BLOCK=4096, ROWS=1, HAS_RESIDUAL=True, QUANT=True, **FP8_CONSTANTS), ("eps",)),
        "silu_and_mul": (fused._silu_and_mul_kernel, dict(X="*bf16", Out="*fp8e4nv", **quant),
                         dict(INTER=14336, BLOCK=16384, QUANT=True, **FP8_CONSTANTS), ()),
        "quantize_tokens": (fused._quantize_tokens_kernel,
                            dict(X="*bf16", Q="*fp8e4nv", Scale="*fp32", StaticScale="*fp32"),
                            dict(BLOCK=4096, **FP8_CONSTANTS), ()),
        "qk_norm_rope_store": (fused._qk_norm_rope_store_kv_kernel,
                               dict(Pos="*i64", Loc="*i64", Q="*bf16", K="*bf16", V="*bf16", Cache="*fp32",
                                    QNormW="*bf16", KNormW="*bf16", KCache="*fp8e4nv", VCache="*fp8e4nv"),
                               dict(HQ=32, HK=8, BLOCK_HQ=32, BLOCK_HK=8, D=128, BLOCK_D=128, HALF=64, HAS_NORM=False,
                                    QUANT=True, FP8_MAX=448.0), ("eps", "k_inv_scale", "v_inv_scale")),
        "fp8_rows": (fp8_triton.fp8_rows_kernel,
                     dict(X="*bf16", XScale="*fp32", W="*fp8e4nv", WScale="*fp32", StaticScale="*fp32", B="*fp32",
                          Out="*bf16", Partial="*fp32", Counters="*i32"),
                     dict(QUANTIZE=True, ROWS=1, BLOCK_N=64, BLOCK_K=256, HAS_BIAS=False, EVEN_K=True, PROMOTE_K=32,
                          SPLIT_K=4, AMAX_BLOCK=4096, **FP8_CONSTANTS), ()),
        "skinny": (skinny_triton.skinny_kernel, dict(X="*bf16", W="*bf16", B="*bf16", Out="*bf16"),
                   dict(ROWS=16, BLOCK_N=32, BLOCK_K=256, HAS_BIAS=False, EVEN_K=True), ()),
    }


def _ptx(name: str, pdl_on: bool) -> str:
    kernel, pointers, constants, floats = _kernels()[name]
    return compile_for_sm90(kernel, pointers, dict(constants, PDL=pdl_on), floats=floats).asm["ptx"]


MEMORY_OPS = ("ld.global", "st.global", "cp.async", "atom.", "red.")


STREAMING = ("decode", "fp8_rows", "skinny")  # kernels with a main loop over a weight or the KV cache


@needs_ptxas
@pytest.mark.parametrize("name", ["decode", "rmsnorm", "silu_and_mul", "quantize_tokens", "qk_norm_rope_store",
                                  "fp8_rows", "skinny"])
def test_kernel_waits_for_the_one_before_before_touching_memory(name):
    """Short kernels let the next one launch at once; streaming ones only after their main loop (its last branch
    back), else the kernels ahead pile up on the GPU."""
    ptx = _ptx(name, True)
    body = ptx[ptx.index("{", ptx.index(".entry")):]  # the parameters' loads come before: kernel arguments
    trigger, wait = body.find("griddepcontrol.launch_dependents"), body.find("griddepcontrol.wait")
    assert trigger >= 0 and wait >= 0
    before = body[:wait]
    assert not [op for op in MEMORY_OPS if op in before], before
    assert ("prefetch.global.L2" in before) == (name in ("fp8_rows", "skinny"))
    if name in STREAMING:
        assert wait < body.rfind("mma") < trigger  # every MMA of the main loop before it
    else:
        assert trigger < wait
    assert "griddepcontrol" not in _ptx(name, False)


def test_prefetch_stays_within_the_budget_and_the_k_range():
    cuda = torch.device("cuda", 0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pdl, "pdl_enabled", lambda device: device.type == "cuda")
        # llama-3.1-8b FP8 qkv at 1 row: 96 programs of 64 rows, K 4096 bytes: 16 MiB / (96 * 64) = 2730 bytes a row
        assert pdl.prefetch_columns(96, 64, 4096, 1, cuda) == 2688  # 21 lines
        assert pdl.prefetch_columns(96, 64, 4096, 2, cuda) == 1344  # bf16: the same bytes
        assert pdl.prefetch_columns(4, 64, 4096, 1, cuda) == 4096  # the whole K range, no more
        assert pdl.prefetch_columns(100000, 64, 4096, 1, cuda) == 0
        for programs, block_n, k, size in ((448, 64, 4096, 1), (224, 64, 3584, 1), (4008, 32, 4096, 2)):
            cols = pdl.prefetch_columns(programs, block_n, k, size, cuda)
            assert cols * size % pdl.L2_LINE == 0 and cols <= k
            assert programs * block_n * cols * size <= pdl.PREFETCH_BUDGET
    assert pdl.prefetch_columns(96, 64, 4096, 1, torch.device("cpu")) == 0


def test_pdl_only_on_hopper_cuda_unless_switched_off(monkeypatch):
    monkeypatch.delenv("PDSERVE_PDL", raising=False)
    cuda = torch.device("cuda", 0)
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    for capability, expected in (((9, 0), True), ((10, 0), True), ((8, 9), False)):
        monkeypatch.setattr(pdl, "_capability", lambda index, c=capability: c)
        assert pdl.pdl_enabled(cuda) is expected
        assert pdl.launch_options(cuda) == ({"PDL": True, "launch_pdl": True} if expected else {"PDL": False})
    monkeypatch.setenv("PDSERVE_PDL", "0")
    assert not pdl.pdl_enabled(cuda)


@pytest.mark.gpu
def test_a_graph_of_pdl_kernels_computes_what_stream_order_does(monkeypatch):
    """RMSNorm, split-K FP8 rows kernels and SiLU, chained eight times in a CUDA graph with PDL, give the bits of the
    same chain in plain stream order, replay after replay (a kernel reading its input early would not)."""
    from pdserve.kernels import fused
    from pdserve.kernels.fp8_rows import Fp8Output, Fp8Rows
    from pdserve.quantization.fp8 import Fp8RowsConfig, fp8_rows_linear, quantize_rows

    device = torch.device("cuda")
    if not pdl.pdl_enabled(device):
        pytest.skip("PDL needs compute capability 9.0")
    generator = torch.Generator(device).manual_seed(0)
    hidden, inter, rows = 1024, 2048, 4
    norm_weight = (torch.rand(hidden, device=device, generator=generator) + 0.5).to(torch.bfloat16)
    up = quantize_rows(torch.randn(2 * inter, hidden, device=device, generator=generator) * 0.05)
    down = quantize_rows(torch.randn(hidden, inter, device=device, generator=generator) * 0.05)
    split = Fp8RowsConfig(64, 256, 4, 3, False, 4)
    x0 = torch.randn(rows, hidden, device=device, generator=generator).to(torch.bfloat16)

    def chain():
        x, residual = x0, torch.zeros_like(x0)
        for _ in range(8):
            (q, scale), residual = fused.rmsnorm(x, norm_weight, 1e-5, residual, Fp8Output())
            h = fp8_rows_linear(Fp8Rows(q, scale, x.dtype), *up, None, None, split)
            q, scale = fused.silu_and_mul(h, Fp8Output())
            x = fp8_rows_linear(Fp8Rows(q, scale, x.dtype), *down, None, None, split)
        return x + residual

    monkeypatch.setenv("PDSERVE_PDL", "0")
    expected = chain()
    monkeypatch.setenv("PDSERVE_PDL", "1")
    chain()  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
