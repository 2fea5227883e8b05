"""Linear layers sharded across the tensor-parallel ranks. Each owns the slicing of its checkpoint tensors
(`load_shard`), so the loader hands every rank the full HF tensor and the layer keeps its part."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed.tensor_parallel import TPGroup, kv_head_start, kv_heads_per_rank
from pdserve.kernels.skinny import linear


@dataclass(frozen=True, slots=True)
class Shard:
    """Of a fused part with `full` output rows, this rank holds rows [start, start + size)."""

    full: int
    start: int
    size: int

    @staticmethod
    def even(full: int, tp: TPGroup) -> Shard:
        size = full // tp.size
        return Shard(full, tp.rank * size, size)

    @staticmethod
    def kv_heads(num_kv_heads: int, head_dim: int, tp: TPGroup) -> Shard:
        first = kv_head_start(num_kv_heads, tp.size, tp.rank)
        return Shard(num_kv_heads * head_dim, first * head_dim, kv_heads_per_rank(num_kv_heads, tp.size) * head_dim)


def _new_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """Output rows split across ranks; a fused projection (qkv, gate_up) lists one `Shard` per part."""

    def __init__(self, in_features: int, shards: list[Shard], bias: bool):
        super().__init__()
        self.shards = shards
        self.offsets = [sum(s.size for s in shards[:i]) for i in range(len(shards))]
        out = sum(s.size for s in shards)
        self.weight = _new_param(out, in_features)
        self.bias = _new_param(out) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    @torch.no_grad()
    def load_shard(self, attr: str, tensor: torch.Tensor, part: int = 0) -> None:
        shard, offset = self.shards[part], self.offsets[part]
        if tensor.shape[0] != shard.full:
            raise ValueError(f"{attr} part {part}: checkpoint has {tensor.shape[0]} rows, the model {shard.full}")
        getattr(self, attr)[offset : offset + shard.size].copy_(tensor[shard.start : shard.start + shard.size])


class RowParallelLinear(nn.Module):
    """Input columns split across ranks; the partial products are summed over the ranks, then the bias added."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.in_per_rank = in_features // tp.size
        self.weight = _new_param(out_features, self.in_per_rank)
        self.bias = _new_param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    @torch.no_grad()
    def load_shard(self, attr: str, tensor: torch.Tensor, part: int = 0) -> None:
        target = getattr(self, attr)
        if attr == "bias":
            target.copy_(tensor)
            return
        expected = (target.shape[0], self.in_per_rank * self.tp.size)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{attr}: checkpoint shape {tuple(tensor.shape)} != model shape {expected}")
        start = self.tp.rank * self.in_per_rank
        target.copy_(tensor[:, start : start + self.in_per_rank])


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows split across ranks (the last rank's part padded); a rank looks up the ids in its range
    and the ranks' rows are summed."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = math.ceil(vocab_size / tp.size)
        self.start = tp.rank * self.rows_per_rank
        self.weight = _new_param(self.rows_per_rank, hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows_per_rank)
        out = F.embedding(local * inside, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)

    @torch.no_grad()
    def load_shard(self, attr: str, tensor: torch.Tensor, part: int = 0) -> None:
        if tuple(tensor.shape) != (self.vocab_size, self.weight.shape[1]):
            raise ValueError(f"{attr}: checkpoint shape {tuple(tensor.shape)} != model shape "
                             f"{(self.vocab_size, self.weight.shape[1])}")
        rows = tensor[self.start : self.start + self.rows_per_rank]
        self.weight.zero_()
        self.weight[: rows.shape[0]].copy_(rows)


class ParallelLMHead(VocabParallelEmbedding):
    """Each rank scores its vocabulary rows; the logits are gathered and the padding cut off."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last_dim(linear(hidden, self.weight))
        return logits[..., : self.vocab_size]
