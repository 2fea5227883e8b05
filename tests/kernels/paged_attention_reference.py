"""Random paged batches and an fp32 gather-and-softmax attention reference for the kernel tests."""

from __future__ import annotations

import torch

from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.mem_cache.kv_pool import KVLayout, KVPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_batch(specs, *, page_size, num_heads, num_kv_heads, head_dim, dtype, device, mode=ForwardMode.EXTEND,
               seed=0):
    """specs: [(prefix_len, extend_len)]. Returns (batch, pool, q, k, v); the pool (and page 0) holds random
    values, pages are shuffled, and prefixes may end mid-page."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_req = [cdiv(p + e, page_size) for p, e in specs]
    num_pages = sum(pages_per_req) + 3
    pool = KVPool(KVLayout(1, num_kv_heads, head_dim, page_size, num_pages, dtype), device)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen).to(dtype))
    page_ids = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    max_pages = max(pages_per_req)
    page_table = torch.zeros(len(specs), max_pages, dtype=torch.int32)
    out_cache_loc, positions = [], []
    for b, ((prefix, extend), n) in enumerate(zip(specs, pages_per_req)):
        row = [page_ids.pop() for _ in range(n)]
        page_table[b, :n] = torch.tensor(row, dtype=torch.int32)
        for pos in range(prefix, prefix + extend):
            positions.append(pos)
            out_cache_loc.append(row[pos // page_size] * page_size + pos % page_size)
    extend_lens = [e for _, e in specs]
    starts = [sum(extend_lens[:i]) for i in range(len(specs))]
    num_tokens = sum(extend_lens)
    as_dev = lambda xs, dt: torch.tensor(xs, dtype=dt, device=device)  # noqa: E731
    batch = ForwardBatch(
        mode=mode,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=as_dev(positions, torch.int64),
        out_cache_loc=as_dev(out_cache_loc, torch.int64),
        seq_lens=as_dev([p + e for p, e in specs], torch.int32),
        prefix_lens=as_dev([p for p, _ in specs], torch.int32),
        extend_lens=as_dev(extend_lens, torch.int32),
        extend_start_loc=as_dev(starts, torch.int32),
        page_table=page_table.to(device),
        logits_indices=as_dev([s + e - 1 for s, e in zip(starts, extend_lens)], torch.int64),
        seq_lens_cpu=[p + e for p, e in specs],
        prefix_lens_cpu=[p for p, _ in specs],
        extend_lens_cpu=extend_lens,
        page_size=page_size,
    )
    shape = lambda h: (num_tokens, h, head_dim)  # noqa: E731
    q = torch.randn(shape(num_heads), generator=gen).to(dtype).to(device)
    k = torch.randn(shape(num_kv_heads), generator=gen).to(dtype).to(device)
    v = torch.randn(shape(num_kv_heads), generator=gen).to(dtype).to(device)
    return batch, pool, q, k, v


def reference_attention(q, k, v, pool: KVPool, batch: ForwardBatch, scaling: float, layer: int = 0):
    """fp32 reference: store k, v with index_copy_ into a copy of the pool, then gather + masked softmax."""
    k_cache = pool.k_buffer(layer).float().index_copy(0, batch.out_cache_loc, k.float())
    v_cache = pool.v_buffer(layer).float().index_copy(0, batch.out_cache_loc, v.float())
    group = q.shape[1] // k.shape[1]
    page_size = batch.page_size
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for b, (prefix, extend) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)):
        seq = prefix + extend
        pos = torch.arange(seq, device=q.device)
        slots = batch.page_table[b, pos // page_size].long() * page_size + pos % page_size
        keys = k_cache[slots].repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = v_cache[slots].repeat_interleave(group, dim=1)
        for c in range(0, extend, 256):
            rows = torch.arange(c, min(extend, c + 256), device=q.device)
            scores = torch.einsum("ehd,shd->hes", q[start + rows].float(), keys) * scaling
            visible = pos[None, :] <= (prefix + rows)[:, None]
            probs = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
            out[start + rows] = torch.einsum("hes,shd->ehd", probs, values)
        start += extend
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||; NaN anywhere makes it NaN (and so fails every `<` check)."""
    diff = (out.double() - ref.double()).norm()
    return float(diff / ref.double().norm())
