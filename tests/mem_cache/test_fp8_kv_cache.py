"""FP8 KV cache without the kernels: the flag, the pool's quantizing store and dequantizing read, twice the tokens in
the same memory, where the scales come from (checkpoint, calibration file, 1.0), the host tier and the checksum over
FP8 bytes, storage keys and the PD handshake that tell FP8 pages (and their scales) from bf16 ones."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hicache_util import hicache, prompts, run, tiered_llm
from safetensors.torch import save_file

from pdserve import LLM
from pdserve.attention.selection import resolve_backend_name
from pdserve.config import KV_CACHE_DTYPE_CHOICES, ConfigError, ServerArgs, build_arg_parser, parse_server_cli
from pdserve.disagg.bootstrap import IncompatiblePeer, check_compatible
from pdserve.disagg.kv_checksum import combined_checksum, head_checksums
from pdserve.engine.model_runner import tokens_in_budget
from pdserve.mem_cache.hiradix_cache import model_identity
from pdserve.mem_cache.host_pool import MEM_LAYOUTS, HostKVPool
from pdserve.mem_cache.kv_pool import KVLayout, KVPool
from pdserve.mem_cache.kv_quant import KV_CACHE_DTYPES, KVScales, cuda_support_problem, fp8_max, quantize
from pdserve.models.kv_scales import checkpoint_kv_scales, load_scales_file, resolve_kv_scales
from pdserve.tools.calibrate_kv_scales import scales_document

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SCALES = KVScales((0.02, 0.5, 0.125), (0.03, 0.25, 1.0))


def layout(dtype: torch.dtype = E4M3, scales: KVScales | None = SCALES, num_pages: int = 12) -> KVLayout:
    return KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, num_pages=num_pages, dtype=dtype,
                    scales=scales)


def test_flag_values_and_refusals():
    parse = lambda *flags: parse_server_cli(build_arg_parser(), ["--model-path", "m", *flags])[1]  # noqa: E731
    assert set(KV_CACHE_DTYPE_CHOICES) == set(KV_CACHE_DTYPES)
    assert parse("--kv-cache-dtype", "fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    assert parse("--kv-cache-dtype=bf16").kv_cache_dtype == "bf16"
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of auto, bf16, bfloat16, fp8_e4m3, fp8_e5m2"):
        parse("--kv-cache-dtype", "fp4_e2m1")
    with pytest.raises(ConfigError, match="--attention-backend flash_attn cannot read a KV cache in fp8_e5m2"):
        ServerArgs(model_path="m", kv_cache_dtype="fp8_e5m2", attention_backend="flash_attn")
    with pytest.raises(ConfigError, match="--kv-cache-scales needs --kv-cache-dtype fp8_e4m3 or fp8_e5m2"):
        ServerArgs(model_path="m", kv_cache_scales="s.json")
    with pytest.raises(ConfigError, match="--kv-cache-scales /nonexistent.json: no such file"):
        ServerArgs(model_path="m", kv_cache_dtype="fp8_e4m3", kv_cache_scales="/nonexistent.json")


def test_auto_attention_avoids_flash_attn_for_fp8_pages(monkeypatch):
    import pdserve.attention.selection as selection

    monkeypatch.setattr(selection, "flash_attn_import_error", lambda: None)  # as if FlashAttention-4 were installed
    assert resolve_backend_name("auto", "cuda", 128, 16, (9, 0), "bfloat16") == "flash_attn"
    assert resolve_backend_name("auto", "cuda", 128, 16, (9, 0), "bfloat16", "float8_e4m3fn") == "sdpa"
    assert resolve_backend_name("triton", "cuda", 128, 16, (9, 0), "bfloat16", "float8_e4m3fn") == "triton"


def test_e4m3_needs_ada_or_hopper():
    assert cuda_support_problem(E4M3, (8, 0)).startswith("--kv-cache-dtype fp8_e4m3 needs compute capability 8.9")
    assert cuda_support_problem(E4M3, (9, 0)) is None and cuda_support_problem(E4M3, (8, 9)) is None
    assert cuda_support_problem(E5M2, (8, 0)) is None and cuda_support_problem(torch.bfloat16, (8, 0)) is None


def test_fp8_pool_holds_twice_the_tokens_of_bf16_in_the_same_memory():
    bf16, fp8 = layout(torch.bfloat16, None), layout(E4M3)
    budget = 10 * 2**20
    assert tokens_in_budget(budget, fp8) == 2 * tokens_in_budget(budget, bf16)
    assert KVPool(fp8, "cpu").nbytes * 2 == KVPool(bf16, "cpu").nbytes
    assert fp8.page_bytes * 2 == bf16.page_bytes  # and half the bytes per page on a PD handoff


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_store_quantizes_and_read_dequantizes(dtype):
    pool = KVPool(layout(dtype), "cpu")
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(5, 2, 8, generator=gen) * 4, torch.randn(5, 2, 8, generator=gen)
    k[0, 0, 0] = 1e6  # clamped to the format's largest value
    slots = torch.tensor([7, 3, 40, 41, 12])
    pool.store(1, slots, k, v)
    assert pool.buffer.dtype == dtype
    assert torch.equal(pool.k_buffer(1)[slots].view(torch.uint8), quantize(k, 0.5, dtype).view(torch.uint8))
    k_read, v_read = pool.read(1, slots)
    assert torch.equal(k_read, quantize(k, 0.5, dtype).float() * 0.5)
    assert torch.equal(v_read, quantize(v, 0.25, dtype).float() * 0.25)
    assert k_read[0, 0, 0] == fp8_max(dtype) * 0.5
    assert (k_read - k).abs().max() > 0 and torch.allclose(k_read[1:], k[1:], rtol=0.13, atol=0.5 * 2**-6)


def test_scales_validation():
    with pytest.raises(ValueError, match="finite positive"):
        KVScales((1.0, 0.0), (1.0, 1.0))
    with pytest.raises(ValueError, match="2 K scales but 1 V scales"):
        KVScales((1.0, 1.0), (1.0,))
    with pytest.raises(ValueError, match="KV scales need an FP8 KV dtype"):
        layout(torch.bfloat16, SCALES)
    assert KVScales((0.1,), (1,)).k == (0.10000000149011612,)  # float32, the kernels' precision


def write_checkpoint(path, tensors: dict) -> list:
    file = path / "model.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2), **tensors}, str(file))
    return [file]


def test_checkpoint_scales_in_every_naming(tmp_path):
    files = write_checkpoint(tmp_path, {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5), "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
        "model.layers.1.self_attn.kv_scale": torch.tensor(2.0),
        "model.layers.2.self_attn.k_proj.output_scale": torch.tensor([0.125, 0.0625]),  # per head: the largest
        "model.layers.2.self_attn.v_proj.output_scale": torch.tensor(1.5),
    })
    assert checkpoint_kv_scales(files, 3) == KVScales((0.5, 2.0, 0.125), (0.25, 2.0, 1.5))
    with pytest.raises(ValueError, match="lacks k_scale of layer 3"):
        checkpoint_kv_scales(files, 4)
    assert checkpoint_kv_scales(write_checkpoint(tmp_path, {}), 3) is None


def test_scales_come_from_the_checkpoint_else_the_file_else_one(tmp_path):
    document = scales_document([8.96, 224.0, 0.0], [4.48, 1.0, 2.0], "fp8_e4m3", "m", 3, 100)
    assert document["k_scale"] == [0.02, 0.5, 1.0] and document["v_scale"][0] == 0.01
    scales_file = tmp_path / "scales.json"
    scales_file.write_text(json.dumps(document))
    bare = write_checkpoint(tmp_path, {})
    assert resolve_kv_scales(3, bare, str(scales_file), "fp8_e4m3") == KVScales((0.02, 0.5, 1.0), (0.01, 1 / 448, 2 / 448))
    assert resolve_kv_scales(3, bare, None, "fp8_e4m3") == KVScales.ones(3)
    with pytest.raises(ValueError, match="calibrated for 'fp8_e4m3', the server runs --kv-cache-dtype fp8_e5m2"):
        load_scales_file(scales_file, 3, "fp8_e5m2")
    with pytest.raises(ValueError, match="must list 4 layers"):
        load_scales_file(scales_file, 4, "fp8_e4m3")
    own = tmp_path / "own"
    own.mkdir()
    with_scales = write_checkpoint(own, {f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor(0.75)
                                         for i in range(3) for kv in "kv"})
    assert resolve_kv_scales(3, with_scales, str(scales_file), "fp8_e4m3") == KVScales((0.75,) * 3, (0.75,) * 3)


@pytest.mark.parametrize("mem_layout", MEM_LAYOUTS)
def test_host_tier_keeps_fp8_pages_as_they_are(mem_layout):
    device = KVPool(layout(), "cpu")
    device.buffer.view(torch.uint8).copy_(torch.randint(0, 120, device.buffer.shape, dtype=torch.uint8))
    host = HostKVPool(device.layout, 6, mem_layout, pin=False)
    host.save(device, [3, 5, 6], [1, 2, 3])
    fresh = KVPool(device.layout, "cpu")
    host.load(fresh, [1, 2, 3], [7, 8, 2])
    ps = device.layout.page_size
    for src, dst in ((3, 7), (5, 8), (6, 2)):
        assert torch.equal(fresh.buffer[:, :, dst * ps:(dst + 1) * ps].view(torch.uint8),
                           device.buffer[:, :, src * ps:(src + 1) * ps].view(torch.uint8))
    assert len(host.read_page(1)) == 2 * 3 * device.layout.page_bytes


def test_checksum_covers_fp8_bytes():
    pool = KVPool(layout(), "cpu")
    pool.store(0, torch.arange(8, 16), torch.randn(8, 2, 8), torch.randn(8, 2, 8))
    before = combined_checksum(head_checksums(pool, [2, 3], 0))
    pool.buffer.view(torch.uint8)[1, 2, 13, 1, 5] ^= 1  # one bit of layer 2's V, page 3, head 1
    assert combined_checksum(head_checksums(pool, [2, 3], 0)) != before


def test_storage_keys_tell_dtypes_and_scales_apart(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    keys = {model_identity(str(tmp_path), lay) for lay in (
        layout(torch.bfloat16, None), layout(E4M3), layout(E5M2),
        layout(E4M3, dataclasses.replace(SCALES, v=(0.03, 0.25, 0.5))))}
    assert len(keys) == 4
    assert model_identity(str(tmp_path), layout(num_pages=12)) == model_identity(str(tmp_path), layout(num_pages=40))


def side(lay: KVLayout) -> dict:
    return {"model": "m", "tp_size": 1, "transfer_backend": "tcp",
            "kv_layout": {**lay.describe(), "total_kv_heads": 2}}


def test_handshake_refuses_other_kv_dtype_or_scales_naming_both():
    check_compatible(side(layout()), side(layout(num_pages=99)))
    with pytest.raises(IncompatiblePeer, match="dtype mismatch: prefill has float8_e4m3fn, decode has bfloat16"):
        check_compatible(side(layout()), side(layout(torch.bfloat16, None)))
    other = dataclasses.replace(SCALES, v=(0.03, 0.25, 0.5))
    with pytest.raises(IncompatiblePeer, match="v_scales mismatch at layer 2: prefill has 1.0, decode has 0.5"):
        check_compatible(side(layout()), side(layout(scales=other)))


def test_fp8_pages_round_trip_the_host_and_storage_tiers_apart_from_unquantized_ones(tiny_model, tmp_path):
    """An FP8 engine's prefix evicted to the host comes back, and its storage blocks serve another FP8 engine,
    each answering as an FP8 engine that computes the prompt whole; a float32-KV engine on the same storage
    directory finds none of those blocks."""
    fp8 = dict(kv_cache_dtype="fp8_e4m3")
    storage = dict(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                   hicache_storage_prefetch_policy="wait_complete")
    base, other1, other2 = prompts(64, 64, 64, seed=4)
    followup = base + [7, 8, 9]
    whole = LLM(tiny_model, device="cpu", dtype="float32", page_size=4, max_total_tokens=512, disable_radix_cache=True,
                skip_server_warmup=True, **fp8)
    expected = run(whole, followup).token_ids
    first = tiered_llm(tiny_model, **fp8, **storage)
    for prompt in (base, other1, other2):  # base's pages leave the device pool for the host
        run(first, prompt)
    out = run(first, followup)
    assert out.cached_tokens == 64 and hicache(first, "hit_tokens_total", "host") > 0
    assert out.token_ids == expected
    assert first.scheduler.radix.wait_for_writes(timeout=30)
    second = tiered_llm(tiny_model, **fp8, **storage)
    out = run(second, followup)
    assert hicache(second, "hit_tokens_total", "storage") == 64 and out.token_ids == expected
    unquantized = tiered_llm(tiny_model, **storage)
    out = run(unquantized, followup)
    assert out.cached_tokens == 0 and hicache(unquantized, "hit_tokens_total", "storage") == 0
    for llm in (first, second, unquantized):
        assert llm.scheduler.radix.wait_for_writes(timeout=30)
        llm.scheduler.radix.close()
