"""Llama, Qwen2 (attention bias) and Qwen3 (per-head q/k RMSNorm) decoder models on pdserve's layers."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.attention.base import ForwardContext
from pdserve.distributed.tensor_parallel import TPGroup, kv_heads_per_rank
from pdserve.kernels import qk_norm_rope_store_kv, silu_and_mul
from pdserve.kernels.pending_rows import RowsWithAmax
from pdserve.kernels.rope_store import RopeStore
from pdserve.layers.linear import (GateUpLinear, ParallelLMHead, QKVLinear, RowParallelLinear, Shard,
                                   VocabParallelEmbedding, fp8_input)
from pdserve.layers.norm import RMSNorm
from pdserve.layers.rotary import RotaryEmbedding
from pdserve.models.model_config import ModelConfig
from pdserve.quantization.formats import Fp8Scheme
from pdserve.quantization.fp8 import FP8_IN_KERNEL_ROWS, GATED_PART


def _fp8(cfg: ModelConfig, prefix: str, *modules: str) -> Fp8Scheme | None:
    """The FP8 scheme of the layer fusing the checkpoint's `modules` under `prefix` (None: unquantized)."""
    return None if cfg.quantization is None else cfg.quantization.for_layer([f"{prefix}.{m}" for m in modules])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, qk_norm: bool, tp: TPGroup):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = cfg.num_heads // tp.size
        self.num_kv_heads = kv_heads_per_rank(cfg.num_kv_heads, tp.size)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        q_shard = Shard.even(cfg.num_heads * cfg.head_dim, tp)
        kv_shard = Shard.kv_heads(cfg.num_kv_heads, cfg.head_dim, tp)
        prefix = f"model.layers.{layer_id}.self_attn"
        self.qkv_proj = QKVLinear(cfg.hidden_size, q_shard, kv_shard, cfg.head_dim, cfg.attention_bias,
                                  _fp8(cfg, prefix, "q_proj", "k_proj", "v_proj"), fused_rotary=not qk_norm)
        o_bias = cfg.attention_bias and cfg.architecture == "LlamaForCausalLM"
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, o_bias, tp,
                                        _fp8(cfg, prefix, "o_proj"),
                                        amax_part=self.num_heads // self.num_kv_heads * self.head_dim)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.scaling = cfg.head_dim**-0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q, k and v stay views of the qkv output: normed and rotated there in place, K/V stored from there."""
        pool, layer = ctx.pool, self.layer_id
        if self.q_norm is None:
            qkv = self.qkv_proj.rotary_and_store(x, RopeStore(
                positions, ctx.backend.out_cache_loc, self.rotary.cos_sin_cache, pool.k_buffer(layer),
                pool.v_buffer(layer), pool.k_scale(layer), pool.v_scale(layer), self.num_heads, self.num_kv_heads,
                self.head_dim))
        else:
            qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk_norm_rope_store_kv(
                positions, q, k, v, self.rotary.cos_sin_cache, pool.k_buffer(layer), pool.v_buffer(layer),
                ctx.backend.out_cache_loc, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                k_scale=pool.k_scale(layer), v_scale=pool.v_scale(layer),
            )
        if self.o_proj.reads_amax_parts(q.shape[0]):  # the decode kernel hands each kv head's amax over too
            out, parts = ctx.backend.forward_with_amax(q, k, v, self.layer_id, ctx.pool, self.scaling)
        else:
            out, parts = ctx.backend.forward(q, k, v, self.layer_id, ctx.pool, self.scaling), None
        rows = out.view(-1, self.q_size)
        return self.o_proj(rows if parts is None else RowsWithAmax(rows, parts))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup):
        super().__init__()
        shard, prefix = Shard.even(cfg.intermediate_size, tp), f"model.layers.{layer_id}.mlp"
        self.gate_up_proj = GateUpLinear(cfg.hidden_size, shard, _fp8(cfg, prefix, "gate_proj", "up_proj"))
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp,
                                           _fp8(cfg, prefix, "down_proj"), amax_part=GATED_PART)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # up to FP8_IN_KERNEL_ROWS rows the down projection's kernel quantizes them itself, sooner than the SiLU
        # kernel's one program a whole row (H100, 2026-11-27: 4.4 us a launch against 1.2 without quantizing), and
        # the gate_up projection's kernel may compute SiLU(gate) * up itself
        if x.shape[0] <= FP8_IN_KERNEL_ROWS:
            return self.down_proj(self.gate_up_proj.silu_and_mul(x))
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), fp8_input(self.down_proj)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, qk_norm: bool, tp: TPGroup):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, qk_norm, tp)
        self.mlp = MLP(cfg, layer_id, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual, ctx: ForwardContext):
        qkv_input = fp8_input(self.self_attn.qkv_proj)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden, fp8=qkv_input)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, qkv_input)
        hidden = self.self_attn(positions, hidden, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual, fp8_input(self.mlp.gate_up_proj))
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    qk_norm = False
    # HF checkpoint name -> (pdserve parameter, part index) for fused projections
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup()):
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.qk_norm, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        fp8_head = cfg.quantization if cfg.quantization is not None and cfg.quantization.lm_head else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, fp8_head)
        if cfg.tie_word_embeddings and fp8_head is None:  # an FP8 LM head holds its own copy of the embedding
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        """Returns the logits of the rows in ctx.batch.logits_indices, in the model's dtype."""
        batch = ctx.batch
        hidden, residual = self.embed_tokens(batch.input_ids), None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(batch.positions, hidden, residual, ctx)
            if ctx.on_layer_done is not None:
                ctx.on_layer_done(i)
        hidden, _ = self.norm(hidden, residual)
        return self.lm_head(hidden[batch.logits_indices])


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
