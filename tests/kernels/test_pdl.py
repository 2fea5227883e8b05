"""Programmatic dependent launch: every kernel of a decode step, compiled for sm_90 with PDL, lets the next kernel
launch and waits for the one before it before it touches memory; without PDL nothing of it is compiled in. Which
launches use it, and a CUDA graph of PDL kernels against plain stream order on a GPU."""

from __future__ import annotations

import re

import pytest
import torch

from sm90_compile import compile_for_sm90, needs_ptxas

from pdserve.kernels import pdl

FP8_CONSTANTS = dict(FP8_MAX=448.0, INV_FP8_MAX=1 / 448, MIN_SCALE=1e-12, STATIC=False, HW_CAST=True)


def _kernels():
    from pdserve.kernels import attention, fused, skinny_triton
    from pdserve.quantization import fp8_triton

    quant = dict(QScale="*fp32", StaticScale="*fp32")
    return {
        "decode": (attention._decode_split_kernel,
                   dict(Q="*bf16", K="*fp8e4nv", V="*i32", PageTable="*i32", SeqLens="*i32", Out="*bf16",
                        PartialO="*fp32", PartialLse="*fp32", Counters="*i32", AmaxOut="*fp32"),
                   dict(GROUP=4, BLOCK_H=16, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=64, MAX_SPLITS=4, MIN_SPLIT_LEN=256,
                        FP16_DOTS=True, V_WORDS=True, PTX=True, AMAX=True), ("sm_scale_log2", "v_scale")),
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
                          Out="*bf16", Partial="*fp32", Counters="*i32", Residual="*bf16", NormWeight="*bf16",
                          ResidualOut="*bf16", Pos="*i64", Loc="*i64", CosSin="*fp32", KCache="*fp8e4nv",
                          VCache="*fp8e4nv", AmaxParts="*fp32", AmaxOut="*fp32"),
                     dict(QUANTIZE=True, ROWS=1, BLOCK_N=64, BLOCK_K=256, HAS_BIAS=False, EVEN_K=True, PROMOTE_K=32,
                          SPLIT_K=4, AMAX_BLOCK=4096, ONE_BLOCK=True, NORM=True, GATED=False, ROPE=True, HEADS_Q=32,
                          HEADS_KV=8, HALF=64, KV_QUANT=True, KV_FP8_MAX=448.0, PARTS=0, PRELOAD=True,
                          **FP8_CONSTANTS),
                     ("eps", "k_inv_scale", "v_inv_scale")),
        "skinny": (skinny_triton.skinny_kernel, dict(X="*bf16", W="*bf16", B="*bf16", Out="*bf16"),
                   dict(ROWS=16, BLOCK_N=32, BLOCK_K=256, HAS_BIAS=False, EVEN_K=True), ()),
    }


def _ptx(name: str, pdl_on: bool) -> str:
    kernel, pointers, constants, floats = _kernels()[name]
    return compile_for_sm90(kernel, pointers, dict(constants, PDL=pdl_on), floats, list(pointers), num_warps=4,
                            num_stages=3).asm["ptx"]


MEMORY_OPS = ("ld.global", "st.global", "cp.async", "atom.", "red.global")


STREAMING = ("decode", "fp8_rows", "skinny")  # kernels with a main loop over a weight or the KV cache


def bytes_loaded_per_thread(ptx: str) -> int:
    """The bytes each thread's `ld.global` instructions in this PTX read (ld.global[.vN].bBITS)."""
    loads = re.findall(r"ld\.global(?:\.\w+)*?(?:\.v(\d))?\.b(\d+)", ptx)
    return sum(int(vector or 1) * int(bits) // 8 for vector, bits in loads)


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
    if name == "fp8_rows":  # its first weight block only (no kernel writes a weight): 64 x 256 bytes, 128 threads
        assert bytes_loaded_per_thread(before) == 64 * 256 // 128
        before = before.replace("ld.global", "")
    assert not [op for op in MEMORY_OPS if op in before], before
    if name in STREAMING:
        assert wait < body.rfind("mma") < trigger  # every MMA of the main loop before it
    else:
        assert trigger < wait
    assert "griddepcontrol" not in _ptx(name, False)


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
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="PDL needs a GPU of compute capability 9.0 or more")
def test_a_graph_of_pdl_kernels_computes_what_stream_order_does(monkeypatch):
    """RMSNorm (its own kernel, or computed by the rows kernel), split-K FP8 rows kernels and SiLU, chained eight
    times in a CUDA graph with PDL, give the bits of the same chain in plain stream order, replay after replay (a
    kernel reading its input early would not)."""
    from pdserve.kernels import fused
    from pdserve.kernels.fp8_rows import Fp8Output, Fp8Rows
    from pdserve.kernels.pending_rows import PendingNorm
    from pdserve.quantization.fp8 import Fp8RowsConfig, fp8_rows_linear, quantize_rows

    device = torch.device("cuda")
    generator = torch.Generator(device).manual_seed(0)
    hidden, inter, rows = 1024, 2048, 2
    norm_weight = (torch.rand(hidden, device=device, generator=generator) + 0.5).to(torch.bfloat16)
    up = quantize_rows(torch.randn(2 * inter, hidden, device=device, generator=generator) * 0.05)
    down = quantize_rows(torch.randn(hidden, inter, device=device, generator=generator) * 0.05)
    split = Fp8RowsConfig(64, 256, 4, 3, False, 4)
    in_kernel = Fp8RowsConfig(64, 256, 4, 3, True, 2)
    x0 = torch.randn(rows, hidden, device=device, generator=generator).to(torch.bfloat16)

    def chain():
        x, residual = x0, torch.zeros_like(x0)
        for layer in range(8):
            if layer % 2:
                residual_out = torch.empty_like(residual)
                h = fp8_rows_linear(PendingNorm(x, residual, norm_weight, 1e-5, Fp8Output(), residual_out), *up,
                                    None, None, in_kernel)
                residual = residual_out
            else:
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
