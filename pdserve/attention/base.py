"""The attention backend interface and the per-forward batch description every backend reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum

import torch

from pdserve.mem_cache.kv_pool import KVPool


class ForwardMode(IntEnum):
    EXTEND = 1  # prefill or chunked prefill, possibly on top of a cached prefix
    DECODE = 2  # one new token per request


@dataclass(slots=True)
class ForwardBatch:
    """One forward pass over B requests and T new tokens (T == B for decode).

    Device tensors:
      input_ids [T] int64, positions [T] int64, out_cache_loc [T] int64 (KV slot of each new token),
      seq_lens [B] int32 (KV length after this pass, new tokens included),
      prefix_lens [B] int32 (KV already cached before this pass), extend_lens [B] int32 (new tokens),
      extend_start_loc [B] int32 (offset of each request's first new token in T),
      page_table [B, max_pages] int32 (page ids; row b covers seq_lens[b] tokens),
      logits_indices [N] int64 (rows of the hidden states whose logits are needed).
    Host copies (`*_cpu`) are lists of ints for backends that loop in Python.
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    page_table: torch.Tensor
    logits_indices: torch.Tensor
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    page_size: int

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


class AttentionBackend(ABC):
    """Stores the new K/V into the paged pool and computes attention for a ForwardBatch.

    `init_forward_metadata` runs once per forward pass (outside the layers); `forward` once per layer.
    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]; returns [T, num_heads, head_dim].
    """

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, pool: KVPool, scaling: float
    ) -> torch.Tensor: ...

    # CUDA-graph hooks: backends that support graphs keep static metadata buffers of max size.
    supports_cuda_graph: bool = False

    def init_cuda_graph_state(self, max_bs: int, max_pages_per_req: int) -> None:
        raise RuntimeError(f"{type(self).__name__} does not support CUDA graphs")
