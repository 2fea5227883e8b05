"""FP8 KV cache in the kernels, on CPU through Triton's interpreter: the fused store kernel quantizes to the same
bytes as the torch path, the decode and extend kernels read FP8 pages as a reference reads the dequantized pool, and
a whole model on the Triton backend generates what a float32 model whose attention reads K/V round-tripped through
the same quantization generates (the reference: torch_native over a float32 pool storing `kv_quant.round_trip`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paged_attention_reference import make_batch, reference_attention, rel_err
from pdserve import SamplingParams
from pdserve.forward_batch import ForwardMode
from pdserve.kernels import build_cos_sin_cache, qk_norm_rope_store_kv_ref
from pdserve.mem_cache.kv_pool import KVPool
from pdserve.mem_cache.kv_quant import KVScales, dequantize, round_trip

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


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


@pytest.mark.gpu
@pytest.mark.parametrize("batch_size", [1, 64], ids=["small-batch-config", "large-batch-config"])
@pytest.mark.parametrize("dtype", FP8)
def test_decode_configs_of_the_engine_read_fp8_pages_cuda(dtype, batch_size):
    """The compiled decode kernel at the block shapes the engine takes for FP8 pages (`decode_config`: 2 warps from
    batch 16, V's words converted by inline PTX), split and not: the float32 reference's output over the dequantized
    pages, shuffled pages of 16 with partial last blocks, llama's group of 4 query heads a kv head."""
    from pdserve.kernels.attention import decode_attention, decode_config, decode_workspace

    batch, pool, q, k, v = make_batch([(0, 1), (700, 1), (3000, 1), (129, 1)], page_size=16, num_heads=16,
                                      num_kv_heads=4, head_dim=128, dtype=torch.bfloat16, device="cuda",
                                      mode=ForwardMode.DECODE)
    fp8 = KVPool(dataclasses.replace(pool.layout, dtype=dtype, scales=KVScales((0.02,), (0.03,))), "cuda")
    fp8.store(0, torch.arange(pool.layout.num_slots, device="cuda"), pool.k_buffer(0), pool.v_buffer(0))
    fp8.store(0, batch.out_cache_loc, k, v)
    dequantized = KVPool(dataclasses.replace(pool.layout, dtype=torch.float32), "cuda")
    dequantized.buffer.copy_(torch.stack([dequantize(fp8.buffer[0], 0.02), dequantize(fp8.buffer[1], 0.03)]))
    loc = batch.out_cache_loc
    ref = reference_attention(q, dequantized.k_buffer(0)[loc], dequantized.v_buffer(0)[loc], dequantized, batch,
                              128**-0.5)
    for max_splits in (1, 8):
        out = torch.full_like(q, float("nan"))
        workspace = decode_workspace(4, 16, 4, 128, max_splits, "cuda")
        decode_attention(q, fp8.k_buffer(0), fp8.v_buffer(0), batch.page_table, batch.seq_lens, out, 128**-0.5, 16,
                         max_splits, workspace, decode_config(batch_size, fp8_cache=True), 0.02, 0.03)
        assert workspace is None or not workspace.counters.any()
        assert rel_err(out, ref) < 1e-2, max_splits
