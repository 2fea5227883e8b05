"""The paged attention kernels keep K and V copies in flight while they compute: compiled for sm_90 on any machine
(Triton's own ptxas, no GPU), with 3 stages the decode kernel double-buffers the K and V tiles and waits for all but
the newest copies (with 2 it holds one buffer), and so does the extend kernel at its engine config."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from sm90_compile import compile_for_sm90 as compile_kernel_for_sm90
from sm90_compile import needs_ptxas

pytestmark = needs_ptxas


DECODE = dict(GROUP=4, BLOCK_H=16, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=128, MAX_SPLITS=2, MIN_SPLIT_LEN=256,
              PTX=False, AMAX=False, PDL=False)


def compile_for_sm90(kernel_name: str, kv_dtype: str, constants: dict, num_stages: int, num_warps: int = 4):
    from pdserve.kernels import attention

    kernel = getattr(attention, kernel_name)
    words = constants.get("V_WORDS", False)
    pointers = dict(Q="*bf16", K=f"*{kv_dtype}", V="*i32" if words else f"*{kv_dtype}", PageTable="*i32",
                    SeqLens="*i32", Out="*bf16", PartialO="*fp32", PartialLse="*fp32", Counters="*i32",
                    PrefixLens="*i32", ExtendLens="*i32", ExtendStart="*i32", AmaxOut="*fp32")
    names = inspect.signature(kernel.fn).parameters
    aligned = [n for n in names if n in pointers or (n.startswith("stride") and n != "stride_pb")]  # as launched
    return compile_kernel_for_sm90(kernel, pointers, constants, ("sm_scale_log2", "v_scale"), aligned, num_warps,
                                   num_stages)


@pytest.mark.parametrize("kv_dtype, tile_bytes", [("bf16", 2 * 128 * 128 * 2), ("fp8e4nv", 2 * 128 * 128)])
def test_decode_copies_stay_in_flight(kv_dtype, tile_bytes):
    constants = dict(DECODE, FP16_DOTS=kv_dtype != "bf16", V_WORDS=kv_dtype != "bf16")
    single = compile_for_sm90("_decode_split_kernel", kv_dtype, constants, 2)
    double = compile_for_sm90("_decode_split_kernel", kv_dtype, constants, 3)
    assert "cp.async.wait_group \t0;" in single.asm["ptx"] and "cp.async.wait_group \t2;" not in single.asm["ptx"]
    assert "cp.async.wait_group \t2;" in double.asm["ptx"]  # the next block's copies stay in flight
    assert tile_bytes <= single.metadata.shared and 2 * tile_bytes <= double.metadata.shared


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8e4nv"])
def test_extend_copies_stay_in_flight(kv_dtype):
    from pdserve.kernels.attention import extend_config

    cfg = extend_config(128, torch.device("cuda"))
    constants = dict(GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"])
    kernel = compile_for_sm90("_extend_kernel", kv_dtype, constants, cfg["num_stages"])
    assert f"cp.async.wait_group \t{cfg['num_stages'] - 1};" in kernel.asm["ptx"]


def test_engine_fp8_decode_config_keeps_copies_in_flight():
    from pdserve.kernels.attention import decode_config

    cfg = decode_config(64, fp8_cache=True)
    constants = dict(DECODE, BLOCK_N=cfg.block_n, MIN_SPLIT_LEN=cfg.min_split_len, FP16_DOTS=True, V_WORDS=True,
                     PTX=True)
    kernel = compile_for_sm90("_decode_split_kernel", "fp8e4nv", constants, cfg.num_stages, cfg.num_warps)
    assert cfg.num_stages >= 3 and f"cp.async.wait_group \t{cfg.num_stages - 1};" in kernel.asm["ptx"]


def test_fp8_v_reaches_the_mma_through_transposing_loads():
    """FP8 V tiles as words (V_WORDS): unpacked to fp16 before shared memory, they reach the PV product through
    transposing ldmatrix loads; as bytes, Triton 3.6 gathers them from shared memory one byte at a time."""
    constants = dict(DECODE, BLOCK_N=64, FP16_DOTS=True)
    words = compile_for_sm90("_decode_split_kernel", "fp8e4nv", dict(constants, V_WORDS=True), 3).asm["ptx"]
    as_bytes = compile_for_sm90("_decode_split_kernel", "fp8e4nv", dict(constants, V_WORDS=False), 3).asm["ptx"]
    assert "ld.shared.b8" in as_bytes and "ld.shared.b8" not in words
    assert re.search(r"ldmatrix\S*\.trans", words) and not re.search(r"ldmatrix\S*\.trans", as_bytes)


@pytest.mark.parametrize("kv_dtype, cvt", [("fp8e4nv", "e4m3x2"), ("fp8e5", "e5m2x2")])
def test_fp8_v_words_convert_by_halves_with_ptx(kv_dtype, cvt):
    """PTX: each half of a V word becomes two fp16 in one `cvt.rn.f16x2` (two a word, 32 a thread for 64 tokens at
    4 warps), where Triton's own per-byte conversion extracts the bytes and pairs them up again first (more byte
    permutes); both still reach the MMA through transposing ldmatrix loads."""
    constants = dict(DECODE, BLOCK_N=64, FP16_DOTS=True, V_WORDS=True)
    ptx = compile_for_sm90("_decode_split_kernel", kv_dtype, dict(constants, PTX=True), 3).asm["ptx"]
    by_bytes = compile_for_sm90("_decode_split_kernel", kv_dtype, constants, 3).asm["ptx"]
    assert f"cvt.rn.f16x2.{cvt}" in ptx and re.search(r"ldmatrix\S*\.trans", ptx)
    assert ptx.count("prmt.b32") < by_bytes.count("prmt.b32")
