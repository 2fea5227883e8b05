"""Linear layers sharded across the tensor-parallel ranks. Each owns the slicing of its checkpoint tensors
(`load_shard`), so the loader hands every rank the full HF tensor and the layer keeps its part.

Given an `Fp8Scheme` a layer holds its weight in float8_e4m3fn with one float32 `weight_scale` per output row
(sliced with the rows where the rows are split; whole where the input columns are) and, for static activations,
a scalar `input_scale`; its forward then runs `fp8_linear`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed.tensor_parallel import TPGroup, kv_head_start, kv_heads_per_rank
from pdserve.kernels import silu_and_mul
from pdserve.kernels.fp8_rows import Fp8Output
from pdserve.kernels.skinny import linear
from pdserve.kernels.pending_rows import PendingNorm, RowsWithAmax
from pdserve.kernels.rope_store import RopeStore
from pdserve.quantization.fp8 import (FP8, FUSED_AMAX_ROWS, Fp8Rows, fp8_gated_linear, fp8_linear,
                                     fp8_rope_linear)
from pdserve.quantization.formats import Fp8Scheme


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


def _new_param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def _add_weight(layer: nn.Module, out_features: int, in_features: int, fp8: Fp8Scheme | None) -> None:
    """`weight` in the model dtype, or FP8 with its `weight_scale` (and `input_scale` for static activations)."""
    layer.weight = _new_param(out_features, in_features, dtype=FP8 if fp8 else None)
    layer.weight_scale = _new_param(out_features, dtype=torch.float32) if fp8 else None
    static = fp8 is not None and fp8.static_activations
    layer.input_scale = nn.Parameter(torch.zeros((), dtype=torch.float32), requires_grad=False) if static else None


def fp8_input(layer: nn.Module) -> Fp8Output | None:
    """What the kernel feeding `layer` (a RMSNorm, SiLU-and-mul) is told so that it hands over its rows quantized
    for an FP8 layer (`Fp8Rows`, at the layer's static input scale if it has one); None for a model-dtype layer."""
    return None if layer.weight_scale is None else Fp8Output(layer.input_scale)


def _matmul(layer: nn.Module, x: torch.Tensor | Fp8Rows | RowsWithAmax, bias: torch.Tensor | None) -> torch.Tensor:
    if layer.weight_scale is None:  # (RowsWithAmax: an FP8 gate_up's rows before a model-dtype down projection)
        return linear(x.evaluate() if isinstance(x, RowsWithAmax) else x, layer.weight, bias)
    return fp8_linear(x, layer.weight, layer.weight_scale, layer.input_scale, bias)


def _per_row(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A weight scale per row: a per-tensor scale (one element) repeated, a per-channel one ([rows] or [rows, 1])
    as it is."""
    scale = scale.reshape(-1)
    return scale.expand(rows) if scale.numel() == 1 else scale


def _load_input_scale(layer: nn.Module, scale: torch.Tensor) -> None:
    """The static input scale: the largest of a fused layer's parts (they all scale the same activation)."""
    layer.input_scale.copy_(torch.maximum(layer.input_scale, scale.reshape(()).float()))


class ColumnParallelLinear(nn.Module):
    """Output rows split across ranks; a fused projection (qkv, gate_up) lists one `Shard` per part."""

    def __init__(self, in_features: int, shards: list[Shard], bias: bool, fp8: Fp8Scheme | None = None):
        super().__init__()
        self.shards = shards
        self.offsets = [sum(s.size for s in shards[:i]) for i in range(len(shards))]
        out = sum(s.size for s in shards)
        _add_weight(self, out, in_features, fp8)
        self.bias = _new_param(out) if bias else None

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        return _matmul(self, x, self.bias)

    @torch.no_grad()
    def load_shard(self, attr: str, tensor: torch.Tensor, part: int = 0) -> None:
        shard, offset = self.shards[part], self.offsets[part]
        if attr == "input_scale":
            _load_input_scale(self, tensor)
            return
        if attr == "weight_scale":
            tensor = _per_row(tensor, shard.full)
        if tensor.shape[0] != shard.full:
            raise ValueError(f"{attr} part {part}: checkpoint has {tensor.shape[0]} rows, the model {shard.full}")
        getattr(self, attr)[offset : offset + shard.size].copy_(tensor[shard.start : shard.start + shard.size])


class QKVLinear(ColumnParallelLinear):
    """The attention's fused [q; k; v] projection (heads split across ranks). fused_rotary: the layer does a plain
    neox rotary and the KV store right after it (no per-head norm), which `rotary_and_store` may do in the FP8 rows
    kernel."""

    def __init__(self, in_features: int, q_shard: Shard, kv_shard: Shard, head_dim: int, bias: bool,
                 fp8: Fp8Scheme | None, fused_rotary: bool):
        super().__init__(in_features, [q_shard, kv_shard, kv_shard], bias, fp8)
        self.num_q_heads, self.num_kv_heads = q_shard.size // head_dim, kv_shard.size // head_dim
        self.head_dim = head_dim
        self.fused_rotary = fused_rotary

    def rotary_and_store(self, x: torch.Tensor | Fp8Rows | PendingNorm, rope: RopeStore) -> torch.Tensor:
        """The qkv rows of x with `rope.apply` done (q and k rotated, k and v stored into the cache); with FP8
        weights through `fp8_rope_linear` (done in the rows kernel where that was tuned faster)."""
        assert self.fused_rotary
        if self.weight_scale is None:
            return rope.apply(linear(x, self.weight, self.bias))
        return fp8_rope_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias, rope)


class GateUpLinear(ColumnParallelLinear):
    """The MLP's fused [gate; up] projection (each part split across ranks), read as SiLU(gate) * up."""

    def __init__(self, in_features: int, shard: Shard, fp8: Fp8Scheme | None = None):
        super().__init__(in_features, [shard, shard], False, fp8)

    def silu_and_mul(self, x: torch.Tensor | Fp8Rows | PendingNorm) -> torch.Tensor | RowsWithAmax:
        """SiLU(gate) * up of x's product, in the model dtype; with FP8 weights through `fp8_gated_linear` (which
        computes it in the rows kernel where that was tuned faster, with each row's amax in parts)."""
        if self.weight_scale is None:
            return silu_and_mul(linear(x, self.weight))
        return fp8_gated_linear(x, self.weight, self.weight_scale, self.input_scale)


class RowParallelLinear(nn.Module):
    """Input columns split across ranks; the partial products are summed over the ranks, then the bias added.
    amax_part: the kernel before may hand the rows over with their amax in parts of so many columns
    (`RowsWithAmax`); kept where this layer reads them (FP8 with dynamic activation scales), else None."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, fp8: Fp8Scheme | None = None,
                 amax_part: int | None = None):
        super().__init__()
        self.tp = tp
        self.in_per_rank = in_features // tp.size
        _add_weight(self, out_features, self.in_per_rank, fp8)
        self.bias = _new_param(out_features) if bias else None
        self.amax_part = amax_part if fp8 is not None and self.input_scale is None else None

    def reads_amax_parts(self, rows: int) -> bool:
        """Whether this many rows handed over with their amax in parts may save this layer's kernel its amax pass
        (as many as the rows kernel is tuned to read them for); else computing the parts is wasted."""
        return self.amax_part is not None and rows <= FUSED_AMAX_ROWS

    def forward(self, x: torch.Tensor | Fp8Rows | RowsWithAmax) -> torch.Tensor:
        out = self.tp.all_reduce(_matmul(self, x, None))
        return out if self.bias is None else out + self.bias

    @torch.no_grad()
    def load_shard(self, attr: str, tensor: torch.Tensor, part: int = 0) -> None:
        target = getattr(self, attr)
        if attr == "input_scale":
            _load_input_scale(self, tensor)
            return
        if attr in ("bias", "weight_scale"):  # per output row: every rank holds them all
            target.copy_(_per_row(tensor, target.shape[0]) if attr == "weight_scale" else tensor)
            return
        expected = (target.shape[0], self.in_per_rank * self.tp.size)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{attr}: checkpoint shape {tuple(tensor.shape)} != model shape {expected}")
        start = self.tp.rank * self.in_per_rank
        target.copy_(tensor[:, start : start + self.in_per_rank])


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows split across ranks (the last rank's part padded); a rank looks up the ids in its range
    and the ranks' rows are summed."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, fp8: Fp8Scheme | None = None):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = math.ceil(vocab_size / tp.size)
        self.start = tp.rank * self.rows_per_rank
        _add_weight(self, self.rows_per_rank, hidden_size, fp8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows_per_rank)
        out = F.embedding(local * inside, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)

    @torch.no_grad()
    def load_shard(self, attr: str, tensor: torch.Tensor, part: int = 0) -> None:
        target = getattr(self, attr)  # the weight, or the FP8 LM head's per-row weight_scale
        expected = (self.vocab_size, *target.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{attr}: checkpoint shape {tuple(tensor.shape)} != model shape {expected}")
        rows = tensor[self.start : self.start + self.rows_per_rank]
        target.zero_()
        target[: rows.shape[0]].copy_(rows)


class ParallelLMHead(VocabParallelEmbedding):
    """Each rank scores its vocabulary rows; the logits are gathered and the padding cut off."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last_dim(_matmul(self, hidden, None))
        return logits[..., : self.vocab_size]
