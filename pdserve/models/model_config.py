"""Model shapes read straight from an HF config.json (old `rope_theta`/`rope_scaling` or new `rope_parameters`)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.config import ConfigError
from pdserve.quantization.formats import Fp8Checkpoint, Fp8Scheme

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    checkpoint_dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    quantization: Fp8Scheme | None = None  # FP8 linear layers: the checkpoint's format, or --quantization's

    def with_quantization(self, flag: str | None, quantize_lm_head: bool) -> "ModelConfig":
        """This config with the FP8 scheme `--quantization` and `--quantize-lm-head` ask of this checkpoint."""
        checkpoint = self.quantization.checkpoint if self.quantization is not None else None
        return dataclasses.replace(self, quantization=Fp8Scheme.resolve(flag, quantize_lm_head, checkpoint))

    def context_len(self, requested: int | None) -> int:
        """--context-length, or the model's own; never past the positions the checkpoint's rotary embedding covers
        (its max_position_embeddings, which already includes any rope scaling the checkpoint declares)."""
        if requested is None:
            return self.max_position_embeddings
        if requested > self.max_position_embeddings:
            raise ConfigError(
                f"--context-length {requested} exceeds this model's max_position_embeddings "
                f"({self.max_position_embeddings}): positions past it have no rotary embedding"
            )
        return requested

    def check_tp_size(self, tp_size: int) -> None:
        """Refuse a tensor-parallel size the model's heads or MLP cannot be split by (KV heads may be replicated)."""
        kv_ok = self.num_kv_heads % tp_size == 0 if self.num_kv_heads >= tp_size else tp_size % self.num_kv_heads == 0
        checks = (("num_attention_heads", self.num_heads, self.num_heads % tp_size == 0),
                  ("num_key_value_heads", self.num_kv_heads, kv_ok),
                  ("intermediate_size", self.intermediate_size, self.intermediate_size % tp_size == 0))
        for name, value, ok in checks:
            if not ok:
                hint = " (nor is --tp-size a multiple of it)" if name == "num_key_value_heads" else ""
                raise ConfigError(f"--tp-size {tp_size} does not divide this model's {name} {value}{hint}")

    @classmethod
    def from_path(cls, model_path: str | Path) -> "ModelConfig":
        path = Path(model_path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} not found: --model-path must be an HF-format model folder")
        cfg = json.loads(config_file.read_text())
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError(f"{config_file} has no 'architectures' entry")
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        return cls(
            architecture=archs[0],
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", archs[0] == "Qwen2ForCausalLM")),
            checkpoint_dtype=_DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"), torch.float32),
            eos_token_ids=_eos_ids(path, cfg),
            quantization=Fp8Scheme.resolve(None, False, Fp8Checkpoint.from_config(cfg)),
        )


def _eos_ids(path: Path, cfg: dict) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [cfg]
    gen = path / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return tuple(ids)


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device.type == "cpu" else (
            checkpoint_dtype if checkpoint_dtype != torch.float32 else torch.bfloat16
        )
    return _DTYPES[name]
