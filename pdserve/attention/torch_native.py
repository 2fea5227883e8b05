"""Reference attention backend: gathers each request's KV from the paged pool (FP8 pages dequantized) and runs
plain torch math in float32."""

from __future__ import annotations

import torch

from pdserve.attention.base import AttentionBackend
from pdserve.forward_batch import ForwardBatch
from pdserve.mem_cache.kv_pool import KVPool


class TorchNativeBackend(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, device, dtype, max_context_len: int):
        self.group = num_heads // num_kv_heads
        self.page_size = page_size
        self.batch: ForwardBatch | None = None
        self.slots: list[torch.Tensor] = []

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.batch = batch
        offsets = torch.arange(max(batch.seq_lens_cpu, default=0), device=batch.page_table.device)
        self.slots = [
            batch.page_table[b, offsets[:n] // self.page_size].long() * self.page_size + offsets[:n] % self.page_size
            for b, n in enumerate(batch.seq_lens_cpu)
        ]

    @property
    def out_cache_loc(self) -> torch.Tensor:
        return self.batch.out_cache_loc

    def forward(self, q, k, v, layer_id: int, pool: KVPool, scaling: float) -> torch.Tensor:
        batch = self.batch
        out = torch.empty_like(q)
        start = 0
        for b, extend in enumerate(batch.extend_lens_cpu):
            prefix = batch.prefix_lens_cpu[b]
            k, v = pool.read(layer_id, self.slots[b])
            out[start : start + extend] = _attend(q[start : start + extend], k, v, prefix, self.group, scaling)
            start += extend
        return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, group: int, scaling: float) -> torch.Tensor:
    """q [E, Hq, D] at positions prefix..prefix+E-1; k, v [S, Hkv, D] float32 for positions 0..S-1."""
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("ehd,shd->hes", q.float(), k) * scaling
    q_pos = torch.arange(prefix, prefix + q.shape[0], device=q.device)[:, None]
    k_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    scores.masked_fill_(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hes,shd->ehd", probs, v).to(q.dtype)
