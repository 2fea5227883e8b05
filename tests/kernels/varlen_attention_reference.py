"""FlashAttention-4's `flash_attn_varlen_func` contract, as FlashAttnBackend calls it, in plain torch (fp32 math).

It checks what FlashAttention-4 asserts about its inputs (dtypes, shapes, which arguments go together), so a
backend that passes the CPU tests with it hands the real kernel valid calls, and records each call's kind.
"""

from __future__ import annotations

import torch


class VarlenReference:
    def __init__(self):
        self.calls: list[str] = []  # "fresh" or "paged", one per call

    def __call__(self, q, k, v, *, cu_seqlens_q, max_seqlen_q, cu_seqlens_k=None, max_seqlen_k=None,
                 seqused_k=None, page_table=None, softmax_scale, causal):
        assert causal and q.dim() == 3 and q.dtype == k.dtype == v.dtype
        batch = check_lengths(cu_seqlens_q, batch=None)
        if page_table is None:
            assert seqused_k is None and k.dim() == 3 and k.shape == v.shape
            check_lengths(cu_seqlens_k, batch)
            self.calls.append("fresh")
        else:
            assert cu_seqlens_k is None and max_seqlen_k is None and k.dim() == 4 and k.shape == v.shape
            assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1 and page_table.shape[0] == batch
            assert seqused_k.dtype == torch.int32 and seqused_k.shape == (batch,) and seqused_k.stride(0) == 1
            self.calls.append("paged")
        cu_q = cu_seqlens_q.tolist()
        assert cu_q[-1] == q.shape[0] and max(b - a for a, b in zip(cu_q, cu_q[1:])) <= max_seqlen_q
        out = torch.empty_like(q)
        for b in range(batch):
            rows = slice(cu_q[b], cu_q[b + 1])
            if page_table is None:
                first, end = cu_seqlens_k[b : b + 2].tolist()
                assert end - first <= max_seqlen_k and end <= k.shape[0]
                out[rows] = causal_attention(q[rows], k[first:end], v[first:end], softmax_scale)
            else:
                pos = torch.arange(int(seqused_k[b]), device=q.device)
                pages, offsets = page_table[b, pos // k.shape[1]].long(), pos % k.shape[1]
                out[rows] = causal_attention(q[rows], k[pages, offsets], v[pages, offsets], softmax_scale)
        return out, None  # (out, lse) as FlashAttention-4 returns them, without lse unless asked


def check_lengths(cu_seqlens: torch.Tensor, batch: int | None) -> int:
    assert cu_seqlens is not None and cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1
    assert cu_seqlens.stride(0) == 1
    assert int(cu_seqlens[0]) == 0 and bool((cu_seqlens[1:] >= cu_seqlens[:-1]).all())
    assert batch is None or cu_seqlens.shape == (batch + 1,)
    return cu_seqlens.shape[0] - 1


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [M, Hq, D] are the last M of the N positions of k, v [N, Hkv, D] (bottom-right causal mask)."""
    group = q.shape[1] // k.shape[1]
    keys, values = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
    scores = torch.einsum("mhd,nhd->hmn", q.float(), keys) * scaling
    offset = k.shape[0] - q.shape[0]
    hidden = torch.arange(k.shape[0])[None, :] > torch.arange(q.shape[0])[:, None] + offset
    probs = scores.masked_fill(hidden.to(q.device), float("-inf")).softmax(-1)
    return torch.einsum("hmn,nhd->mhd", probs, values).to(q.dtype)
