from __future__ import annotations

import itertools
import math

import pytest
import torch

from paged_attention_reference import make_batch, reference_attention, rel_err
from pdserve.forward_batch import ForwardMode

pytestmark = pytest.mark.gpu
TOL = 1e-2
CONFIGS = list(itertools.product([1, 16, 64], [1, 2, 4, 8], [64, 128]))  # page_size, gqa ratio, head_dim


def run_backend(backend_cls, specs, page_size, group, head_dim, mode, seed, num_kv_heads=2, **kw):
    num_heads = num_kv_heads * group
    batch, pool, q, k, v = make_batch(
        specs, page_size=page_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        dtype=torch.bfloat16, device="cuda", mode=mode, seed=seed,
    )
    scaling = 1 / math.sqrt(head_dim)
    ref = reference_attention(q, k, v, pool, batch, scaling)
    backend = backend_cls(num_heads, num_kv_heads, head_dim, page_size, "cuda", torch.bfloat16, 32768, **kw)
    backend.init_forward_metadata(batch)
    pool.store(0, backend.out_cache_loc, k, v)  # the layer's store (kernels.qk_norm_rope_store_kv)
    out = backend.forward(q, k, v, 0, pool, scaling)
    with_amax, parts = backend.forward_with_amax(q, k, v, 0, pool, scaling)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == q.dtype and torch.equal(with_amax, out)
    if parts is not None:  # the decode kernel's: each kv head's part of a row
        assert torch.equal(parts, out.float().abs().view(out.shape[0], num_kv_heads, -1).amax(dim=2))
    assert torch.equal(pool.k_buffer(0)[batch.out_cache_loc], k)
    assert torch.equal(pool.v_buffer(0)[batch.out_cache_loc], v)
    return out, ref


@pytest.mark.parametrize("page_size,group,head_dim", CONFIGS)
def test_decode_ragged(page_size, group, head_dim):
    from pdserve.attention.triton_backend import TritonAttnBackend

    seq_lens = [1, 2, 63, 64, 65, 257, 1000, 4500, 6001]
    specs = [(s - 1, 1) for s in seq_lens]
    out, ref = run_backend(TritonAttnBackend, specs, page_size, group, head_dim, ForwardMode.DECODE, seed=page_size)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("batch_size", [1, 3, 80, 256])
def test_decode_split_counts(batch_size):
    """Batch sizes giving 64, 16, 1 and 1 KV splits (8 kv heads), long and short contexts mixed."""
    from pdserve.attention.triton_backend import TritonAttnBackend

    gen = torch.Generator().manual_seed(batch_size)
    seq_lens = torch.randint(1, 9000 if batch_size < 80 else 1500, (batch_size,), generator=gen).tolist()
    out, ref = run_backend(TritonAttnBackend, [(s - 1, 1) for s in seq_lens], 16, 4, 128, ForwardMode.DECODE,
                           seed=batch_size, num_kv_heads=8)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("page_size,group,head_dim", CONFIGS)
def test_extend_prefix_ragged(page_size, group, head_dim):
    from pdserve.attention.triton_backend import TritonAttnBackend

    # fresh prefill, radix hits mid-page, chunked prefill on an aligned prefix, extends of 1, a long prefix
    specs = [(0, 1), (0, 200), (37, 100), (4096, 300), (130, 1), (5, 129), (0, 4500), (4111, 17)]
    out, ref = run_backend(TritonAttnBackend, specs, page_size, group, head_dim, ForwardMode.EXTEND,
                           seed=100 + page_size)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("with_prefix", [False, True])
def test_sdpa_backend(with_prefix):
    """Mixed lengths: requests >= SDPA_MIN_LEN through SDPA, the others through the Triton extend kernel."""
    from pdserve.attention.sdpa_backend import SdpaAttnBackend

    specs = [(0, 1), (0, 300), (0, 4500), (0, 77), (0, 1024), (0, 1023)]
    if with_prefix:
        specs[1] = (40, 260)
    out, ref = run_backend(SdpaAttnBackend, specs, 16, 4, 128, ForwardMode.EXTEND, seed=7)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("head_dim", [64, 128])
def test_extend_candidate_configs(head_dim):
    """Every block configuration the benchmark sweeps computes the same function."""
    from pdserve.bench.kernels import EXTEND_CANDIDATES
    from pdserve.kernels.attention import extend_attention

    specs = [(0, 1), (37, 300), (4096, 129), (0, 700)]
    batch, pool, q, k, v = make_batch(specs, page_size=16, num_heads=16, num_kv_heads=8, head_dim=head_dim,
                                      dtype=torch.bfloat16, device="cuda", seed=head_dim)
    pool.store(0, batch.out_cache_loc, k, v)
    ref = reference_attention(q, k, v, pool, batch, 0.1)
    for cfg in EXTEND_CANDIDATES[head_dim]:
        out = torch.full_like(q, float("nan"))
        extend_attention(q, pool.k_buffer(0), pool.v_buffer(0), batch.page_table, batch.prefix_lens,
                         batch.extend_lens, batch.extend_start_loc, 700, out, 0.1, 16, config=cfg)
        assert rel_err(out, ref) < TOL, cfg


def test_kernels_write_every_output():
    """Poisoned outputs: the kernels must overwrite every row of every request."""
    from pdserve.kernels.attention import decode_attention, decode_num_splits, extend_attention

    specs = [(0, 33), (70, 5), (999, 1)]
    batch, pool, q, k, v = make_batch(specs, page_size=16, num_heads=8, num_kv_heads=2, head_dim=128,
                                      dtype=torch.bfloat16, device="cuda")
    pool.store(0, batch.out_cache_loc, k, v)
    out = torch.full_like(q, float("nan"))
    extend_attention(q, pool.k_buffer(0), pool.v_buffer(0), batch.page_table, batch.prefix_lens, batch.extend_lens,
                     batch.extend_start_loc, max(batch.extend_lens_cpu), out, 0.1, 16)
    assert rel_err(out, reference_attention(q, k, v, pool, batch, 0.1)) < TOL
    dspecs = [(s, 1) for s in (0, 5, 3000)]
    batch, pool, q, k, v = make_batch(dspecs, page_size=16, num_heads=8, num_kv_heads=2, head_dim=128,
                                      dtype=torch.bfloat16, device="cuda", mode=ForwardMode.DECODE)
    pool.store(0, batch.out_cache_loc, k, v)
    for splits in (1, 4, decode_num_splits(3, 2, q.device)):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, pool.k_buffer(0), pool.v_buffer(0), batch.page_table, batch.seq_lens, out, 0.1, 16, splits)
        assert rel_err(out, reference_attention(q, k, v, pool, batch, 0.1)) < TOL


def test_store_kv_matches_index_copy():
    from pdserve.kernels.attention import store_kv

    k_cache = torch.randn(4096, 8, 128, device="cuda").bfloat16()
    v_cache = torch.randn_like(k_cache)
    qkv = torch.randn(100, 48, 128, device="cuda").bfloat16()  # q (32 heads) | k (8) | v (8): strided views
    k, v = qkv[:, 32:40], qkv[:, 40:]
    loc = torch.randperm(4096, device="cuda")[:100]
    expect_k, expect_v = k_cache.index_copy(0, loc, k), v_cache.index_copy(0, loc, v)
    store_kv(k, v, k_cache, v_cache, loc)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


@pytest.mark.parametrize("backend_name", ["triton", "sdpa"])
def test_decode_cuda_graph_replay(backend_name):
    """Capture at bs=8 with padding rows, replay batches of 5 and 8 with new lengths; no host sync inside."""
    from pdserve.attention.sdpa_backend import SdpaAttnBackend
    from pdserve.attention.triton_backend import TritonAttnBackend
    from pdserve.kernels.attention import store_kv

    cls = TritonAttnBackend if backend_name == "triton" else SdpaAttnBackend
    page_size, num_heads, num_kv_heads, head_dim, bs = 16, 16, 4, 128, 8
    backend = cls(num_heads, num_kv_heads, head_dim, page_size, "cuda", torch.bfloat16, 8192)
    backend.init_cuda_graph_state(max_bs=16, max_pages_per_req=512)
    batch, pool, _, _, _ = make_batch([(8000, 1)] * 8, page_size=page_size, num_heads=num_heads,
                                      num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=torch.bfloat16,
                                      device="cuda", mode=ForwardMode.DECODE)  # only to size the pool
    static_q = torch.randn(bs, num_heads, head_dim, device="cuda").bfloat16()
    static_k = torch.randn(bs, num_kv_heads, head_dim, device="cuda").bfloat16()
    static_v = torch.randn_like(static_k)
    backend.init_forward_metadata_capture_cuda_graph(bs)

    def layer_step():  # as a layer does: store the new K/V at the backend's (static) slots, then attend
        store_kv(static_k, static_v, pool.k_buffer(0), pool.v_buffer(0), backend.out_cache_loc)
        return backend.forward(static_q, static_k, static_v, 0, pool, 0.08)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer_step()  # warm-up (compiles)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer_step()
    for n, seed in ((5, 1), (8, 2), (5, 3)):
        gen = torch.Generator().manual_seed(seed)
        lens = torch.randint(1, 8000, (n,), generator=gen).tolist()
        real, pool2, q, k, v = make_batch([(s - 1, 1) for s in lens], page_size=page_size, num_heads=num_heads,
                                          num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=torch.bfloat16,
                                          device="cuda", mode=ForwardMode.DECODE, seed=seed)
        assert pool2.buffer.shape[2] <= pool.buffer.shape[2]
        pool.buffer[:, :, : pool2.buffer.shape[2]].copy_(pool2.buffer)
        ref = reference_attention(q, k, v, pool, real, 0.08)
        static_q.normal_()
        static_k.normal_()
        static_v.normal_()
        static_q[:n], static_k[:n], static_v[:n] = q, k, v
        static_out.fill_(float("nan"))
        backend.init_forward_metadata_replay_cuda_graph(real, bs)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(static_out[:n], ref) < TOL
        assert not static_out[n:].isnan().any()
        assert torch.equal(pool.k_buffer(0)[real.out_cache_loc], k)
