"""FlashAttnBackend against the torch_native backend.

On CPU (no FlashAttention-4 there) the backend's batching runs with a torch implementation of FlashAttention-4's
varlen contract in place of the kernel (`varlen_attention_reference`), and the Triton KV store and decode through
Triton's interpreter (fp32): random fresh-only, mixed prefix / no-prefix and chunked-prefill batches, page sizes
1 and 16, GQA. On a GPU with flash_attn.cute, the real kernels in bf16.
"""

from __future__ import annotations

import math
import random
import time

import pytest
import torch

from paged_attention_reference import make_batch, reference_attention, rel_err
from pdserve.attention.selection import flash_attn_installed
from pdserve.forward_batch import ForwardMode
from pdserve.mem_cache.kv_pool import KVPool
from varlen_attention_reference import VarlenReference

NUM_KV_HEADS, HEAD_DIM, SCALING = 2, 64, 0.125
CHUNK = 32  # the chunked-prefill chunk size of the random chunked batches


def attend(backend, batch, pool, q, k, v, scaling=SCALING):
    """One layer's attention: the new tokens' K/V go into the pool at their slots first, as the model's
    layer stores them (a backend that stores them too writes the same values), then the backend attends."""
    backend.init_forward_metadata(batch)
    pool.store(0, batch.out_cache_loc, k, v)
    return backend.forward(q, k, v, 0, pool, scaling)


def copy_of(pool: KVPool) -> KVPool:
    twin = KVPool(pool.layout, pool.buffer.device)
    twin.buffer.copy_(pool.buffer)
    return twin


def random_specs(kind: str, rng: random.Random) -> list[tuple[int, int]]:
    """(prefix_len, extend_len) per request, as the scheduler forms extend batches."""
    fresh = [(0, rng.randint(1, 40)) for _ in range(rng.randint(1, 3))]
    if kind == "fresh":
        return fresh
    if kind == "mixed":  # radix-cache hits (any length here) next to fresh prompts
        return fresh + [(rng.randint(1, 100), rng.randint(1, 30)) for _ in range(rng.randint(1, 2))]
    assert kind == "chunked"  # one prompt's later chunk on top of its earlier ones, fresh prompts beside it
    return [(CHUNK * rng.randint(1, 3), rng.randint(1, CHUNK))] + fresh[:2]


def run_both(specs, page_size, group, attention_fn, mode=ForwardMode.EXTEND, seed=0):
    from pdserve.attention.flash_attn_backend import FlashAttnBackend
    from pdserve.attention.torch_native import TorchNativeBackend

    num_heads = NUM_KV_HEADS * group
    batch, pool, q, k, v = make_batch(specs, page_size=page_size, num_heads=num_heads, num_kv_heads=NUM_KV_HEADS,
                                      head_dim=HEAD_DIM, dtype=torch.float32, device="cpu", mode=mode, seed=seed)
    args = (num_heads, NUM_KV_HEADS, HEAD_DIM, page_size, "cpu", torch.float32, 4096)
    expected = attend(TorchNativeBackend(*args), batch, copy_of(pool), q, k, v)
    backend = FlashAttnBackend(*args, attention_fn=attention_fn)
    return backend, attend(backend, batch, pool, q, k, v), expected


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("kind", ["fresh", "mixed", "chunked"])
def test_random_prefill_batches_match_torch_native(interpreted, kind, group, page_size):
    rng = random.Random(f"{kind}-{group}-{page_size}")
    for seed in range(2):
        specs = random_specs(kind, rng)
        reference = VarlenReference()
        _, out, expected = run_both(specs, page_size, group, reference, seed=seed)
        assert out.shape == expected.shape and out.dtype == expected.dtype
        assert rel_err(out, expected) < 1e-5, specs
        # one FlashAttention-4 call per layer: through the page table as soon as any request has a prefix
        assert reference.calls == ["paged" if any(p for p, _ in specs) else "fresh"]


def never_called(*args, **kwargs):
    raise AssertionError("decode must run on the Triton kernels")


@pytest.mark.parametrize("page_size,group", [(1, 2), (16, 4)])
def test_decode_runs_on_triton(interpreted, page_size, group):
    specs = [(0, 1), (70, 1), (600, 1)]  # the 601-token request takes 2 KV splits
    _, out, expected = run_both(specs, page_size, group, never_called, mode=ForwardMode.DECODE)
    assert rel_err(out, expected) < 1e-5


def test_cuda_graph_decode_after_a_prefill_runs_on_triton(interpreted):
    """A replayed decode right after an extend batch (whose plan the backend still holds) must not reach FA4."""
    from pdserve.attention.torch_native import TorchNativeBackend

    backend, _, _ = run_both([(0, 5), (9, 3)], 4, 2, VarlenReference())
    assert backend.plan is not None
    backend.attention_fn = never_called
    specs = [(40, 1), (3, 1), (300, 1)]
    batch, pool, q, k, v = make_batch(specs, page_size=4, num_heads=2 * NUM_KV_HEADS, num_kv_heads=NUM_KV_HEADS,
                                      head_dim=HEAD_DIM, dtype=torch.float32, device="cpu", mode=ForwardMode.DECODE)
    expected = attend(TorchNativeBackend(2 * NUM_KV_HEADS, NUM_KV_HEADS, HEAD_DIM, 4, "cpu", torch.float32, 4096),
                      batch, copy_of(pool), q, k, v)
    backend.init_cuda_graph_state(len(specs), batch.page_table.shape[1])
    backend.init_forward_metadata_replay_cuda_graph(batch, len(specs))
    pool.store(0, batch.out_cache_loc, k, v)
    out = backend.forward(q, k, v, 0, pool, SCALING)
    assert rel_err(out, expected) < 1e-5
    with_amax, parts = backend.forward_with_amax(q, k, v, 0, pool, SCALING)  # the Triton decode kernel's parts
    assert torch.equal(with_amax, out) and torch.equal(parts, out.abs().view(3, NUM_KV_HEADS, -1).amax(dim=2))


@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_warm_up_calls_fresh_and_paged_for_one_and_several_query_tiles(page_size, caplog):
    pytest.importorskip("triton")
    from pdserve.attention.flash_attn_backend import WARMUP_QUERY_LENS, warm_up

    reference = VarlenReference()
    with caplog.at_level("INFO", logger="pdserve.attention.flash_attn_backend"):
        warm_up(reference, 8, 2, HEAD_DIM, page_size, torch.device("cpu"), torch.float32)
    assert reference.calls == ["fresh", "paged"] * len(WARMUP_QUERY_LENS)
    assert "FlashAttention-4 prefill kernels (fresh and paged, query lengths 1 and 256) ready in" in caplog.text


# ------------------------------------------------------------------------------------------------ GPU: real FA4

needs_fa4 = pytest.mark.skipif(not flash_attn_installed(), reason="flash_attn.cute (FlashAttention-4) not installed")
GPU_TOL = 1e-2  # as tests/kernels/test_attention_gpu.py: bf16 against the fp32 reference
FRESH = [(0, 1), (0, 200), (0, 4500), (0, 77), (0, 129)]
MIXED = [(0, 1), (0, 200), (37, 100), (4096, 300), (130, 1), (5, 129), (0, 4500), (4111, 17)]
CHUNKED = [(2048, 2048), (0, 300), (0, 5)]


def run_fa4(specs, page_size, group, head_dim, num_kv_heads=2, seed=0):
    from pdserve.attention.flash_attn_backend import FlashAttnBackend

    num_heads = num_kv_heads * group
    batch, pool, q, k, v = make_batch(specs, page_size=page_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                      head_dim=head_dim, dtype=torch.bfloat16, device="cuda", seed=seed)
    scaling = 1 / math.sqrt(head_dim)
    expected = reference_attention(q, k, v, pool, batch, scaling)
    backend = FlashAttnBackend(num_heads, num_kv_heads, head_dim, page_size, "cuda", torch.bfloat16, 32768)
    out = attend(backend, batch, pool, q, k, v, scaling)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == q.dtype
    return backend, out, expected


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("specs", [FRESH, MIXED, CHUNKED], ids=["fresh", "mixed", "chunked"])
@pytest.mark.parametrize("page_size", [1, 16, 128])  # 128: FlashAttention-4's TMA page path (one key tile)
@pytest.mark.parametrize("group,head_dim", [(1, 128), (4, 128), (8, 64)])
def test_fa4_prefill_matches_reference(specs, page_size, group, head_dim):
    backend, out, expected = run_fa4(specs, page_size, group, head_dim, seed=page_size)
    assert backend.plan.paged == any(p for p, _ in specs)
    assert rel_err(out, expected) < GPU_TOL


@pytest.mark.gpu
@needs_fa4
def test_warm_up_compiles_what_prefill_uses():
    """After the backend is built, fresh and paged batches of short and long queries run without compiling
    (a compile takes seconds; a run, milliseconds)."""
    run_fa4([(0, 3)], 16, 4, 128)  # builds (and warms up) once
    for specs in ([(0, 3)], [(0, 300), (0, 20)], [(16, 3)], [(300, 300), (0, 20)]):
        started = time.perf_counter()
        _, out, expected = run_fa4(specs, 16, 4, 128)
        assert time.perf_counter() - started < 1.0, specs
        assert rel_err(out, expected) < GPU_TOL
