"""The attention backend interface, and the context a model's forward pass hands its layers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.forward_batch import ForwardBatch
from pdserve.mem_cache.kv_pool import KVPool


class AttentionBackend(ABC):
    """Attention over the paged KV pool for a ForwardBatch.

    `init_forward_metadata` runs once per forward pass (outside the layers). Then each layer first writes its new
    tokens' K and V into the pool at the slots `out_cache_loc` names (the model does it, fused with rotary:
    `kernels.qk_norm_rope_store_kv`), and only then calls `forward`, which reads the pool: a backend never
    stores K/V itself. q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim], the values just stored
    (views of the qkv projection's output); returns a new contiguous [T, num_heads, head_dim].
    """

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    @property
    @abstractmethod
    def out_cache_loc(self) -> torch.Tensor:
        """[T] int64: the pool slot of each new token of the current forward pass (under CUDA graphs, the
        static buffer the captured graph reads)."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, pool: KVPool, scaling: float
    ) -> torch.Tensor: ...

    def forward_with_amax(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, pool: KVPool,
                          scaling: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, and each output row's amax in parts ([T, num_kv_heads] float32, one part a kv head's query
        heads: `pdserve.kernels.pending_rows.RowsWithAmax`) where the backend's kernel takes them as it writes
        (the Triton decode kernel), None elsewhere."""
        return self.forward(q, k, v, layer_id, pool, scaling), None

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
