"""Physical ceilings measured on the device, and the bytes/FLOPs a model run must move or compute."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.models.model_config import ModelConfig


def time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() on the current CUDA stream, timed with events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@dataclass(frozen=True, slots=True)
class Ceilings:
    hbm_gbps: float  # device-to-device copy, bytes read + written
    matmul_tflops: float  # bf16 8192^3

    @classmethod
    def measure(cls) -> "Ceilings":
        src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        copy_ms = time_ms(partial(dst.copy_, src))
        del src, dst
        a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        mm_ms = time_ms(lambda: a @ b)
        return cls(hbm_gbps=4 * (1 << 30) / copy_ms / 1e6, matmul_tflops=2 * 8192**3 / mm_ms / 1e9)


@dataclass(frozen=True, slots=True)
class ModelCost:
    weight_bytes: int
    layer_params: int  # matmul parameters of the decoder layers (the LM head runs once per sequence in prefill)
    kv_bytes_per_token: int
    attn_flops_per_pair: int  # QK^T and PV for one (query token, key position) pair, all layers

    @classmethod
    def of(cls, cfg: ModelConfig, itemsize: int = 2, kv_itemsize: int | None = None) -> "ModelCost":
        """itemsize: bytes per weight; kv_itemsize: per KV value (default itemsize; 1 for an FP8 KV cache)."""
        h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
        embed = cfg.vocab_size * h
        fp8 = cfg.quantization  # FP8 linear weights: one byte each (their per-row scales are noise)
        layer_itemsize = 1 if fp8 is not None else itemsize
        head_itemsize = 1 if fp8 is not None and fp8.lm_head else itemsize
        # a decode step reads every layer and the LM head; the embedding lookup touches a few rows only
        return cls(
            weight_bytes=layers * per_layer * layer_itemsize + embed * head_itemsize,
            layer_params=layers * per_layer,
            kv_bytes_per_token=2 * layers * kv * (kv_itemsize or itemsize),
            attn_flops_per_pair=4 * layers * q,
        )

    def decode_step_bytes(self, kv_tokens_read: int) -> int:
        return self.weight_bytes + kv_tokens_read * self.kv_bytes_per_token

    def prefill_flops(self, tokens: int, attention_pairs: int) -> int:
        return 2 * self.layer_params * tokens + self.attn_flops_per_pair * attention_pairs


@dataclass(slots=True)
class WorkCounters:
    """What the forward passes did, counted by `observe` as a `ModelRunner.forward_observers` entry."""

    decode_steps: int = 0
    decode_tokens: int = 0
    decode_kv_tokens_read: int = 0
    extend_steps: int = 0
    extend_tokens: int = 0
    extend_attention_pairs: int = 0  # sum over new tokens of the KV positions each attends to

    def observe(self, batch: ForwardBatch) -> None:
        if batch.mode == ForwardMode.DECODE:
            self.decode_steps += 1
            self.decode_tokens += batch.batch_size
            self.decode_kv_tokens_read += sum(batch.seq_lens_cpu)
            return
        self.extend_steps += 1
        self.extend_tokens += batch.num_tokens
        self.extend_attention_pairs += sum(
            e * (2 * p + e + 1) // 2 for p, e in zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)
        )
