"""FP8 KV cache in the kernels, on CPU through Triton's interpreter: the fused store kernel quantizes to the same
bytes as the torch path, the decode and extend kernels read FP8 pages as a reference reads the dequantized pool, and
a whole model on the Triton backend generates what a float32 model whose attention reads K/V round-tripped through
the same quantization generates (the reference: torch_native over a float32 pool storing `kv_quant.round_trip`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from paged_attention_reference import make_batch, reference_attention, rel_err
from pdserve import SamplingParams
from pdserve.forward_batch import ForwardMode
from pdserve.kernels import attention
from pdserve.kernels import build_cos_sin_cache, qk_norm_rope_store_kv_ref
from pdserve.mem_cache.kv_pool import KVPool
from pdserve.mem_cache.kv_quant import KVScales, dequantize, round_trip

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture
def fp8_interpreted(interpreted, monkeypatch):
    """The interpreter rounds float -> FP8 wrong (Triton 3.6 adds the cut-off bit without carrying it into the
    exponent: 7.69 -> 4.0 in E5M2); the GPU's cvt.rn rounds to nearest even, as torch does, so cast through torch."""
    from triton.runtime import interpreter

    import triton.language as tl

    to_torch = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
    convert = interpreter._convert_float

    def convert_float(data, src, dst, rounding_mode):
        if dst in to_torch and src.primitive_bitwidth > 8:
            values = torch.from_numpy(np.asarray(data).astype(np.float32))
            return values.to(to_torch[dst]).view(torch.uint8).numpy().view(np.uint8).reshape(np.shape(data))
        return convert(data, src, dst, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert_float)


@pytest.mark.parametrize("dtype", FP8)
def test_fused_store_quantizes_to_the_torch_bytes(fp8_interpreted, dtype):
    from pdserve.kernels import fused

    gen = torch.Generator().manual_seed(3)
    tokens, hq, hk, dim = 9, 4, 2, 32
    qkv = torch.randn(tokens, hq + 2 * hk, dim, generator=gen) * 3
    positions = torch.randint(0, 100, (tokens,), generator=gen)
    cache = build_cos_sin_cache(1.0 / (1e4 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)), 128)
    loc = torch.randperm(32, generator=gen)[:tokens]
    norm_w = torch.rand(dim, generator=gen) + 0.5
    outputs = []
    for store in (qk_norm_rope_store_kv_ref, fused.qk_norm_rope_store_kv):
        x = qkv.clone()
        k_cache, v_cache = torch.zeros(32, hk, dim, dtype=dtype), torch.zeros(32, hk, dim, dtype=dtype)
        store(positions, x[:, :hq], x[:, hq:hq + hk], x[:, hq + hk:], cache, k_cache, v_cache, loc, norm_w, norm_w,
              1e-6, k_scale=0.0123, v_scale=0.5)
        outputs.append((x, k_cache.view(torch.uint8), v_cache.view(torch.uint8)))
    (x_ref, k_ref, v_ref), (x_out, k_out, v_out) = outputs
    assert rel_err(x_out, x_ref) < 1e-6
    assert k_ref.any() and torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)


def fp8_copy(pool: KVPool, dtype: torch.dtype, scales: KVScales) -> KVPool:
    """`pool` (float32) stored in an FP8 pool at `scales`."""
    fp8 = KVPool(dataclasses.replace(pool.layout, dtype=dtype, scales=scales), "cpu")
    slots = torch.arange(pool.layout.num_slots)
    fp8.store(0, slots, pool.k_buffer(0), pool.v_buffer(0))
    return fp8


DECODE_SPECS = [(0, 1), (70, 1), (600, 1)]


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("mode, specs, q_dtype, tolerance", [
    (ForwardMode.DECODE, DECODE_SPECS, torch.float32, 1e-5),
    (ForwardMode.DECODE, DECODE_SPECS, torch.bfloat16, 5e-3),  # the decode kernel's fp16 dots (FP16_DOTS)
    (ForwardMode.EXTEND, [(0, 9), (6, 40), (45, 1)], torch.float32, 1e-5),
])
def test_decode_and_extend_read_fp8_pages(interpreted, dtype, mode, specs, q_dtype, tolerance):
    from pdserve.attention.triton_backend import TritonAttnBackend

    batch, pool, q, k, v = make_batch(specs, page_size=4, num_heads=4, num_kv_heads=2, head_dim=64,
                                      dtype=torch.float32, device="cpu", mode=mode)
    scales = KVScales((0.02,), (0.03,))
    fp8 = fp8_copy(pool, dtype, scales)
    backend = TritonAttnBackend(4, 2, 64, 4, "cpu", torch.float32, 4096)
    backend.init_forward_metadata(batch)
    fp8.store(0, backend.out_cache_loc, k, v)
    # the reference reads the same pool dequantized, and the new tokens as the FP8 pool holds them
    dequantized = KVPool(pool.layout, "cpu")
    dequantized.buffer[0, 0], dequantized.buffer[1, 0] = (dequantize(fp8.buffer[i, 0], s) for i, s in
                                                          ((0, 0.02), (1, 0.03)))
    k_rt, v_rt = round_trip(k, 0.02, dtype), round_trip(v, 0.03, dtype)
    q = q.to(q_dtype).float()  # the reference sees the queries the kernels get
    ref = reference_attention(q, k_rt, v_rt, dequantized, batch, 0.125)
    out = backend.forward(q.to(q_dtype), k, v, 0, fp8, 0.125)
    assert rel_err(out.float(), ref) < tolerance
    unquantized = reference_attention(q, k, v, pool, batch, 0.125)
    assert rel_err(out, unquantized) > 1e-3  # the FP8 pages were read, not some full-precision copy


def round_trip_reference(llm, scales: KVScales, dtype: torch.dtype, monkeypatch) -> None:
    """Make a float32 engine's layers store K and V as FP8 at `scales` gives them back (kept in float32)."""
    import pdserve.kernels.ops as ops

    def store(cache, loc, values, scale):
        cache.index_copy_(0, loc, round_trip(values.float(), scale, dtype))

    pool = llm.scheduler.runner.pool
    monkeypatch.setattr(ops, "write_slots", store)
    monkeypatch.setattr(pool, "k_scale", lambda layer: scales.k[layer])
    monkeypatch.setattr(pool, "v_scale", lambda layer: scales.v[layer])


def test_triton_and_torch_native_generate_the_round_trip_reference(interpreted, tiny_models, tmp_path, monkeypatch):
    """qwen3-tiny with head_dim 64 (the Triton kernels' smallest): FP8 KV greedy tokens on the torch_native and
    the interpreted Triton backend equal the round-trip reference's, and differ from the unquantized model's."""
    import json

    from pdserve import LLM
    from pdserve.tools import make_model

    monkeypatch.setitem(make_model.PRESETS, "qwen3-tiny-hd64",
                        dataclasses.replace(make_model.PRESETS["qwen3-tiny"], name="qwen3-tiny-hd64", head_dim=64))
    path = make_model.make_model("qwen3-tiny-hd64", tmp_path / "model", seed=0)
    scales_file = tmp_path / "scales.json"
    scales = KVScales((0.004, 0.005), (0.006, 0.004))  # the largest |K| and |V| clamp at 448 x scale
    scales_file.write_text(json.dumps({"format": "pdserve-kv-scales", "kv_cache_dtype": "fp8_e4m3",
                                       "k_scale": list(scales.k), "v_scale": list(scales.v)}))
    prompts = [[(i * 37 + 11) % 900 + 3 for i in range(40)], [5, 17, 250, 3, 99, 7]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    common = dict(device="cpu", max_total_tokens=512, context_length=256, page_size=4, skip_server_warmup=True,
                  disable_overlap_schedule=True, disable_radix_cache=True)

    def tokens(**engine) -> list[list[int]]:
        llm = LLM(str(path), **common, **engine)
        try:
            return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()

    unquantized = tokens(attention_backend="torch_native")
    reference_llm = LLM(str(path), **common, attention_backend="torch_native")
    with pytest.MonkeyPatch.context() as patch:
        round_trip_reference(reference_llm, scales, torch.float8_e4m3fn, patch)
        reference = [o.token_ids for o in reference_llm.generate(prompts, params, use_tqdm=False)]
    reference_llm.shutdown()
    fp8 = dict(kv_cache_dtype="fp8_e4m3", kv_cache_scales=str(scales_file))
    assert tokens(attention_backend="torch_native", **fp8) == reference
    assert tokens(attention_backend="triton", **fp8) == reference
    assert reference != unquantized  # the quantization (and its clamping) is visible


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FP8)
def test_fp8_store_and_attention_cuda(dtype):
    """The compiled kernels on bf16: the fused store writes the torch path's bytes, decode and extend read the pages
    as the float32 reference reads them dequantized."""
    from pdserve.attention.triton_backend import TritonAttnBackend
    from pdserve.kernels import fused

    gen = torch.Generator().manual_seed(5)
    qkv = (torch.randn(37, 8 + 2 * 2, 128, generator=gen) * 3).to(torch.bfloat16).cuda()
    positions = torch.randint(0, 4000, (37,), generator=gen).cuda()
    cache = build_cos_sin_cache(1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)), 4096).cuda()
    loc = torch.randperm(64, generator=gen)[:37].cuda()
    stored = []
    for store in (qk_norm_rope_store_kv_ref, fused.qk_norm_rope_store_kv):
        x = qkv.clone()
        kc, vc = (torch.zeros(64, 2, 128, dtype=dtype, device="cuda") for _ in range(2))
        store(positions, x[:, :8], x[:, 8:10], x[:, 10:], cache, kc, vc, loc, k_scale=0.0123, v_scale=0.5)
        stored.append((kc.view(torch.uint8), vc.view(torch.uint8)))
    assert all(torch.equal(a, b) for a, b in zip(*stored))
    for mode, specs in ((ForwardMode.DECODE, [(0, 1), (700, 1), (3000, 1)]), (ForwardMode.EXTEND, [(0, 90), (60, 40)])):
        batch, pool, q, k, v = make_batch(specs, page_size=16, num_heads=8, num_kv_heads=2, head_dim=128,
                                          dtype=torch.bfloat16, device="cuda", mode=mode)
        fp8 = KVPool(dataclasses.replace(pool.layout, dtype=dtype, scales=KVScales((0.02,), (0.03,))), "cuda")
        slots = torch.arange(pool.layout.num_slots, device="cuda")
        fp8.store(0, slots, pool.k_buffer(0), pool.v_buffer(0))
        backend = TritonAttnBackend(8, 2, 128, 16, "cuda", torch.bfloat16, 8192)
        backend.init_forward_metadata(batch)
        fp8.store(0, backend.out_cache_loc, k, v)
        reference_pool = KVPool(dataclasses.replace(pool.layout, dtype=torch.float32), "cuda")
        reference_pool.buffer.copy_(torch.stack([dequantize(fp8.buffer[0], 0.02), dequantize(fp8.buffer[1], 0.03)]))
        ref = reference_attention(q, round_trip(k.float(), 0.02, dtype), round_trip(v.float(), 0.03, dtype),
                                  reference_pool, batch, 128**-0.5)
        assert rel_err(backend.forward(q, k, v, 0, fp8, 128**-0.5), ref) < 2e-2


@triton.jit
def _e4m3_words_kernel(Words, Out, N: tl.constexpr):
    w = tl.load(Words + tl.arange(0, N))
    tl.store(Out + tl.arange(0, 4 * N), tl.reshape(attention._e4m3_quads_to_fp16(w), (4 * N,)))


def test_e4m3_words_become_fp16_times_2_pow_minus_8(interpreted):
    """Every E4M3 byte but NaN, 4 to an int32 word, comes out as its value times 2^-8 in fp16, in byte order."""
    from triton.runtime.interpreter import InterpretedFunction

    convert = InterpretedFunction(_e4m3_words_kernel.fn)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F] + [0, 0], dtype=torch.uint8)  # 254 + 2 pad
    out = torch.empty(256, dtype=torch.float16)
    convert[(1,)](codes.view(torch.int32), out, N=64)
    expected = codes.view(torch.float8_e4m3fn).float() * 2.0**-8
    assert torch.equal(out.float(), expected)


FP8_VARIANTS = [dict(fp8_bits=b, cuda_cores=c, k_rows=r) for b in (False, True) for c in (False, True)
                for r in (False, True)][1:]


def fp8_decode_case(group: int):
    """A decode batch over an E4M3 cache holding subnormals and +-448 (seq lens 1, 38, 151: none a multiple of the
    kernel's 32-token blocks), bf16 queries, and the float32 reference over the dequantized pages."""
    batch, pool, q, _, _ = make_batch([(0, 1), (37, 1), (150, 1)], page_size=4, num_heads=2 * group, num_kv_heads=2,
                                      head_dim=32, dtype=torch.float32, device="cpu", mode=ForwardMode.DECODE)
    values = pool.buffer[:, 0] * 8
    values[..., 0] *= 2.0**-9  # subnormal in E4M3
    values[..., 1] = values[..., 1].sign() * 448  # the largest E4M3
    k_cache, v_cache = values.to(torch.float8_e4m3fn)
    dequantized = KVPool(pool.layout, "cpu")
    dequantized.buffer[0, 0], dequantized.buffer[1, 0] = k_cache.float() * 0.02, v_cache.float() * 0.03
    new = batch.out_cache_loc
    q = q.to(torch.bfloat16)
    ref = reference_attention(q.float(), dequantized.k_buffer(0)[new], dequantized.v_buffer(0)[new], dequantized,
                              batch, 0.125)
    return batch, q, k_cache, v_cache, ref


@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("max_splits", [1, 4])
def test_fp8_decode_variants_match_the_default(interpreted, group, max_splits):
    """DecodeConfig's FP8 variants (pdserve.bench.decode_sweep times them) compute the default kernel's output: the
    bit conversion and the K row tiles exactly (up to fp32 reassociation), the CUDA-core products up to the default's
    fp16 rounding of the probabilities."""
    from pdserve.kernels.attention import DecodeConfig, decode_attention

    batch, q, k_cache, v_cache, ref = fp8_decode_case(group)

    def decode(**variant) -> torch.Tensor:
        out = torch.empty_like(q)
        cfg = DecodeConfig(block_n=32, num_warps=4, num_stages=1, min_split_len=32, **variant)
        return decode_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens, out, 0.125, 4, max_splits,
                                config=cfg, k_scale=0.02, v_scale=0.03).float()

    default = decode()
    assert rel_err(default, ref) < 5e-3
    for variant in FP8_VARIANTS:
        assert rel_err(decode(**variant), default) < (1e-4 if variant["cuda_cores"] else 1e-6), variant
