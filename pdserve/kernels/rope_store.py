"""What a decoder layer does with its qkv projection's rows right after the product (no per-head norm): neox rotary
of the q and k heads and the new k and v written into the layer's KV cache (`ops.qk_norm_rope_store_kv`). Handed to
the FP8 projection, whose rows kernel does it as it writes where the tuner measured that faster (a decode batch of
one or two rows: the rotary kernel's launch and its gap in the decode graph saved); anywhere else `apply` runs the
rotary kernel after the product. Either way the same qkv output and the same cache bytes, with the same float32
arithmetic on the rounded product."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.ops import qk_norm_rope_store_kv


@dataclass(frozen=True, slots=True)
class RopeStore:
    """positions, loc: [T] int64 (the rows' positions and cache slots); cos_sin_cache: [max_pos, head_dim] float32
    (cos then sin); k_cache, v_cache: [slots, num_kv_heads, head_dim] (one layer of the KVPool), FP8 ones stored at
    k_scale, v_scale. The qkv rows are q heads, then k heads, then v heads, head_dim columns each."""

    positions: torch.Tensor
    loc: torch.Tensor
    cos_sin_cache: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: float
    v_scale: float
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    def apply(self, qkv: torch.Tensor) -> torch.Tensor:
        """The rotary and the cache store on a qkv product [T, (num_q_heads + 2 * num_kv_heads) * head_dim] (q and k
        rotated in place); returns qkv."""
        q, k, v = qkv.split([self.num_q_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                             self.num_kv_heads * self.head_dim], dim=-1)
        heads = (self.num_q_heads, self.num_kv_heads, self.num_kv_heads)
        q, k, v = (part.view(-1, n, self.head_dim) for part, n in zip((q, k, v), heads))
        qk_norm_rope_store_kv(self.positions, q, k, v, self.cos_sin_cache, self.k_cache, self.v_cache, self.loc,
                              k_scale=self.k_scale, v_scale=self.v_scale)
        return qkv

    @staticmethod
    def sample(rows: int, num_q_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype,
               device: torch.device) -> RopeStore:
        """A RopeStore of `rows` rows on buffers of its own (positions and slots 0.., a random cos/sin cache), for
        timing the kernels that do it."""
        ids = torch.arange(rows, device=device)
        cache = torch.empty(rows, num_kv_heads, head_dim, dtype=kv_dtype, device=device)
        return RopeStore(ids, ids, torch.randn(rows, head_dim, device=device), cache, torch.empty_like(cache), 1.0, 1.0,
                         num_q_heads, num_kv_heads, head_dim)
