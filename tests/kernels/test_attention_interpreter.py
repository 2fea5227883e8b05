"""The attention kernels on CPU through Triton's interpreter (small shapes; the GPU tests cover the matrix).

fp32 only: Triton 3.6's interpreter returns garbage for tl.dot on bf16 operands (seen 2026-11-21, NumPy 2.4).
"""

from __future__ import annotations

import pytest
import torch

from paged_attention_reference import make_batch, reference_attention, rel_err
from pdserve.forward_batch import ForwardMode


@pytest.mark.parametrize("page_size,group", [(1, 2), (4, 1)])
def test_decode_and_extend_interpreted(interpreted, page_size, group):
    from pdserve.attention.triton_backend import TritonAttnBackend

    for mode, specs in (
        (ForwardMode.DECODE, [(0, 1), (70, 1), (600, 1)]),  # the 601-token request takes 2 KV splits
        (ForwardMode.EXTEND, [(0, 9), (6, 40), (45, 1)]),
    ):
        batch, pool, q, k, v = make_batch(specs, page_size=page_size, num_heads=2 * group, num_kv_heads=2,
                                          head_dim=64, dtype=torch.float32, device="cpu", mode=mode)
        ref = reference_attention(q, k, v, pool, batch, 0.125)
        backend = TritonAttnBackend(2 * group, 2, 64, page_size, "cpu", torch.float32, 4096)
        backend.init_forward_metadata(batch)
        assert torch.equal(backend.out_cache_loc, batch.out_cache_loc)
        pool.store(0, backend.out_cache_loc, k, v)  # the layer's store (kernels.qk_norm_rope_store_kv)
        out = backend.forward(q, k, v, 0, pool, 0.125)
        assert rel_err(out, ref) < 1e-5
        with_amax, parts = backend.forward_with_amax(q, k, v, 0, pool, 0.125)  # the decode kernel's parts only
        assert torch.equal(with_amax, out)
        if mode == ForwardMode.DECODE:
            assert torch.equal(parts, out.abs().view(3, 2, group * 64).amax(dim=2))
        else:
            assert parts is None


def test_sdpa_backend_hybrid_interpreted(interpreted):
    """One request long enough for SDPA, one short one through the (interpreted) Triton extend kernel."""
    from pdserve.attention.sdpa_backend import SDPA_MIN_LEN, SdpaAttnBackend

    specs = [(0, SDPA_MIN_LEN + 3), (0, 20)]
    batch, pool, q, k, v = make_batch(specs, page_size=4, num_heads=4, num_kv_heads=2, head_dim=64,
                                      dtype=torch.float32, device="cpu")
    ref = reference_attention(q, k, v, pool, batch, 0.125)
    backend = SdpaAttnBackend(4, 2, 64, 4, "cpu", torch.float32, 4096)
    backend.init_forward_metadata(batch)
    assert backend.split is not None and backend.split.long_rows == [(0, SDPA_MIN_LEN + 3)]
    pool.store(0, backend.out_cache_loc, k, v)
    out = backend.forward(q, k, v, 0, pool, 0.125)
    assert rel_err(out, ref) < 1e-5
    assert backend.forward_with_amax(q, k, v, 0, pool, 0.125)[1] is None
    decode, pool, q, k, v = make_batch([(30, 1), (50, 1)], page_size=4, num_heads=4, num_kv_heads=2, head_dim=64,
                                       dtype=torch.float32, device="cpu", mode=ForwardMode.DECODE)
    backend.init_forward_metadata(decode)  # decode goes to the Triton backend, amax parts and all
    pool.store(0, backend.out_cache_loc, k, v)
    out, parts = backend.forward_with_amax(q, k, v, 0, pool, 0.125)
    assert torch.equal(parts, out.abs().view(2, 2, 2 * 64).amax(dim=2))


def test_split_decode_merges_in_its_last_program_and_resets_its_counters(interpreted):
    """One launch merges the KV splits (the last split program of each request and kv head does it): the output
    matches the reference, the counters are zero again after it, and a second launch on the same workspace gives the
    same bits."""
    from pdserve.kernels.attention import DecodeConfig, decode_attention, decode_workspace

    batch, pool, q, k, v = make_batch([(0, 1), (300, 1), (700, 1)], page_size=4, num_heads=4, num_kv_heads=2,
                                      head_dim=64, dtype=torch.float32, device="cpu", mode=ForwardMode.DECODE)
    pool.store(0, batch.out_cache_loc, k, v)
    ref = reference_attention(q, k, v, pool, batch, 0.125)
    workspace = decode_workspace(3, 4, 2, 64, 8, "cpu")
    config = DecodeConfig(block_n=32, min_split_len=64)  # the 701-token request takes all 8 splits
    outs = []
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, pool.k_buffer(0), pool.v_buffer(0), batch.page_table, batch.seq_lens, out, 0.125, 4, 8,
                         workspace, config)
        assert rel_err(out, ref) < 1e-5 and not workspace.counters.any()
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("max_splits", [1, 8])
def test_decode_leaves_each_rows_amax_in_parts_interpreted(interpreted, max_splits):
    """amax_parts[b, h]: the amax of request b's output over kv head h's query heads (a merged output's where the
    KV is split), and the output is the one written without them."""
    from pdserve.kernels.attention import DecodeConfig, decode_attention, decode_workspace

    batch, pool, q, k, v = make_batch([(0, 1), (300, 1), (700, 1)], page_size=4, num_heads=6, num_kv_heads=2,
                                      head_dim=64, dtype=torch.float32, device="cpu", mode=ForwardMode.DECODE)
    pool.store(0, batch.out_cache_loc, k, v)
    workspace = decode_workspace(3, 6, 2, 64, max_splits, "cpu")
    config = DecodeConfig(block_n=32, min_split_len=64)
    args = (q, pool.k_buffer(0), pool.v_buffer(0), batch.page_table, batch.seq_lens)
    plain, out = torch.empty_like(q), torch.empty_like(q)
    decode_attention(*args, plain, 0.125, 4, max_splits, workspace, config)
    parts = torch.full((3, 2), float("nan"))
    decode_attention(*args, out, 0.125, 4, max_splits, workspace, config, amax_parts=parts)
    assert torch.equal(out, plain)
    assert torch.equal(parts, out.abs().view(3, 2, 3 * 64).amax(dim=2))


def test_eager_decode_steps_reuse_their_split_counters(interpreted):
    from pdserve.attention.triton_backend import TritonAttnBackend

    batch, pool, q, k, v = make_batch([(0, 1), (600, 1)], page_size=4, num_heads=4, num_kv_heads=2, head_dim=64,
                                      dtype=torch.float32, device="cpu", mode=ForwardMode.DECODE)
    backend = TritonAttnBackend(4, 2, 64, 4, "cpu", torch.float32, 4096)
    counters = []
    for _ in range(2):
        backend.init_forward_metadata(batch)
        pool.store(0, backend.out_cache_loc, k, v)
        backend.forward(q, k, v, 0, pool, 0.125)
        counters.append(backend.metadata.workspace.counters)
    assert counters[0].data_ptr() == counters[1].data_ptr() and not counters[1].any()
