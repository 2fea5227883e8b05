"""The attention backend interface, and the context a model's forward pass hands its layers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.forward_batch import ForwardBatch
from pdserve.mem_cache.kv_pool import KVPool


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


@dataclass(slots=True)
class ForwardContext:
    batch: ForwardBatch
    backend: AttentionBackend
    pool: KVPool
    on_layer_done: Callable[[int], None] | None = None  # called with each layer's index once its KV is stored
