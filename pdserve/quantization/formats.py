"""The FP8 checkpoint formats of config.json's `quantization_config`, read (`Fp8Scheme.resolve`) and written
(`Fp8Checkpoint.config`, `Fp8Checkpoint.quantize`), and how a checkpoint's tensors become the layers' form
(`LinearTensors`): an FP8 weight [N, K] with one float32 scale per output channel.

- `quant_method: "fp8"` (AutoFP8, vLLM, llm-compressor's older output): `weight` float8_e4m3fn with `weight_scale`
  per tensor (a scalar) or per output channel; `activation_scheme` dynamic, or static with a scalar `input_scale`;
  block-wise with `weight_block_size` [bn, bk] and `weight_scale_inv` per block (re-quantized per channel at load:
  a second rounding).
- `quant_method: "compressed-tensors"`, float-quantized: one config group of 8-bit float weights (`strategy`
  channel, `weight_scale` [N, 1], or tensor) and 8-bit float input activations (dynamic, or static per tensor with
  `input_scale`).
- A bf16/fp16/fp32 checkpoint under `--quantization fp8`: each weight quantized per output channel at load.

A per-tensor scale becomes that scale on every row (the parts of a fused qkv or gate_up keep their own); the
static input scales of fused parts become their maximum (one activation, one scale).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

import torch

from pdserve.config import ConfigError
from pdserve.quantization.fp8 import FP8, FP8_MAX, MIN_SCALE, quantize_rows, to_fp8

Method = Literal["fp8", "compressed-tensors"]
WeightScales = Literal["channel", "tensor", "block"]
DEFAULT_BLOCK = (128, 128)
BLOCK_SCALE = "weight_scale_inv"  # the fp8 format's name for block scales (multiplied in, despite the name)
IGNORED = ["lm_head"]  # what the checkpoints `make_model` writes leave unquantized (as AutoFP8 and llm-compressor do)


@dataclass(frozen=True, slots=True)
class Fp8Checkpoint:
    """What an FP8 checkpoint holds: its `quant_method`, how its weight scales are laid out, whether it carries
    static input scales, which modules it leaves unquantized."""

    method: Method
    weight_scales: WeightScales = "channel"
    static_activations: bool = False
    block: tuple[int, int] = DEFAULT_BLOCK  # with weight_scales "block"
    ignore: tuple[str, ...] = ()  # modules left unquantized: a name, a last part of names, or "re:" a regex

    def __post_init__(self) -> None:
        if self.method == "compressed-tensors" and self.weight_scales == "block":
            raise ValueError("pdserve writes and reads block-wise scales in the fp8 format only")

    def ignores(self, module: str) -> bool:
        """Whether the checkpoint leaves `module` ("model.layers.0.mlp.down_proj") unquantized."""
        return any(re.match(entry[3:], module) if entry.startswith("re:") else module == entry
                   or module.endswith("." + entry) for entry in self.ignore)

    # ---- reading ----------------------------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: dict) -> "Fp8Checkpoint | None":
        """The format config.json declares; None for an unquantized checkpoint; ConfigError for any other method."""
        qc = config.get("quantization_config") or config.get("compression_config")
        if not qc:
            return None
        method = qc.get("quant_method")
        if method == "fp8":
            return cls._from_fp8(qc)
        if method == "compressed-tensors":
            return cls._from_compressed_tensors(qc)
        raise ConfigError(f"the checkpoint is quantized with {method!r}, which pdserve does not load "
                          "(it loads fp8 and compressed-tensors FP8 checkpoints)")

    @classmethod
    def _from_fp8(cls, qc: dict) -> "Fp8Checkpoint":
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ConfigError(f"fp8 checkpoint: activation_scheme {scheme!r} is neither dynamic nor static")
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or any(not isinstance(b, int) or b <= 0 for b in block)):
            raise ConfigError(f"fp8 checkpoint: weight_block_size {block!r} is not two positive integers")
        ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
        return cls("fp8", "block" if block else "tensor", scheme == "static", tuple(block or DEFAULT_BLOCK), ignore)

    @classmethod
    def _from_compressed_tensors(cls, qc: dict) -> "Fp8Checkpoint":
        groups = list((qc.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ConfigError(f"compressed-tensors checkpoint: pdserve loads one config group, this one has {len(groups)}")
        weights, inputs = groups[0].get("weights") or {}, groups[0].get("input_activations")
        if not _is_fp8(weights) or weights.get("strategy") not in ("channel", "tensor"):
            raise ConfigError(f"compressed-tensors checkpoint: weights {_describe(weights)} are not FP8 per channel "
                              "or per tensor, which is what pdserve loads")
        if not inputs or not _is_fp8(inputs) or inputs.get("strategy") not in ("token", "tensor"):
            raise ConfigError(f"compressed-tensors checkpoint: input activations {_describe(inputs)} are not FP8 "
                              "per token or per tensor (weight-only FP8 is not served)")
        static = not inputs.get("dynamic", True)
        if static and inputs.get("strategy") != "tensor":
            raise ConfigError("compressed-tensors checkpoint: static input scales must be per tensor")
        return cls("compressed-tensors", weights["strategy"], static, ignore=tuple(qc.get("ignore") or ()))

    # ---- writing ----------------------------------------------------------------------------------------------

    def config(self) -> dict:
        """config.json's `quantization_config` for this format."""
        if self.method == "fp8":
            qc = {"quant_method": "fp8", "fmt": "e4m3", "ignored_layers": IGNORED,
                  "activation_scheme": "static" if self.static_activations else "dynamic"}
            return qc | ({"weight_block_size": list(self.block)} if self.weight_scales == "block" else {})
        float8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
        return {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "output_activations": None,
                "weights": float8 | {"strategy": self.weight_scales, "dynamic": False},
                "input_activations": float8 | ({"strategy": "tensor", "dynamic": False} if self.static_activations
                                               else {"strategy": "token", "dynamic": True}),
            }},
            "ignore": IGNORED, "kv_cache_scheme": None,
        }

    def quantize(self, prefix: str, weight: torch.Tensor, input_amax: float) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of one linear layer `prefix` ("model.layers.0.mlp.down_proj") whose weight is
        `weight` and whose inputs reach `input_amax` (for a static input scale)."""
        if self.weight_scales == "channel":
            q, scale = quantize_rows(weight)
            tensors = {"weight": q, "weight_scale": scale[:, None] if self.method == "compressed-tensors" else scale}
        elif self.weight_scales == "tensor":
            scale = (weight.abs().amax().float() / FP8_MAX).clamp(min=MIN_SCALE)
            tensors = {"weight": to_fp8(weight.float() / scale),
                       "weight_scale": scale.reshape(1) if self.method == "compressed-tensors" else scale}
        else:
            q, scale = quantize_blocks(weight, self.block)
            tensors = {"weight": q, BLOCK_SCALE: scale}
        if self.static_activations:
            tensors["input_scale"] = torch.tensor([input_amax / FP8_MAX], dtype=torch.float32)
        return {f"{prefix}.{name}": t for name, t in tensors.items()}


def _is_fp8(args: dict) -> bool:
    return args.get("type") == "float" and args.get("num_bits") == 8 and args.get("symmetric", True)


def _describe(args: dict | None) -> str:
    if not args:
        return "(none)"
    return ", ".join(f"{k}={args.get(k)}" for k in ("type", "num_bits", "strategy", "symmetric", "dynamic"))


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """How the model's linear layers run FP8: from a checkpoint's format, or (checkpoint None) quantized at load;
    the LM head too with `lm_head`."""

    checkpoint: Fp8Checkpoint | None
    lm_head: bool = False

    @property
    def static_activations(self) -> bool:
        return self.checkpoint is not None and self.checkpoint.static_activations

    @property
    def method(self) -> Method:
        return "fp8" if self.checkpoint is None else self.checkpoint.method

    def for_layer(self, modules: list[str]) -> "Fp8Scheme | None":
        """This scheme for the layer that fuses the checkpoint's `modules`, or None where the checkpoint leaves
        them unquantized; ConfigError where it leaves only some of them."""
        if self.checkpoint is None:
            return self
        ignored = [self.checkpoint.ignores(m) for m in modules]
        if any(ignored) and not all(ignored):
            raise ConfigError(f"the checkpoint quantizes some of {', '.join(modules)} but not all; pdserve fuses "
                              "them into one layer")
        return None if all(ignored) else self

    @staticmethod
    def resolve(flag: str | None, quantize_lm_head: bool, checkpoint: Fp8Checkpoint | None) -> "Fp8Scheme | None":
        """The scheme of `--quantization` (None: not given) and `--quantize-lm-head` over the checkpoint's format:
        an FP8 checkpoint needs no flag; a flag naming another method is refused."""
        if checkpoint is not None:
            if flag is not None and flag != checkpoint.method:
                raise ConfigError(f"--quantization {flag} does not match the checkpoint's quantization_config "
                                  f"(quant_method {checkpoint.method}); leave the flag out to load it as it is")
            return Fp8Scheme(checkpoint, quantize_lm_head)
        if flag == "compressed-tensors":
            raise ConfigError("--quantization compressed-tensors needs a checkpoint quantized by compressed-tensors; "
                              "this one has no quantization_config (--quantization fp8 quantizes it at load)")
        if flag is None:
            if quantize_lm_head:
                raise ConfigError("--quantize-lm-head needs --quantization fp8 or an FP8 checkpoint")
            return None
        return Fp8Scheme(None, quantize_lm_head)

    def describe(self) -> dict:
        """What /get_model_info reports."""
        source = "quantized at load" if self.checkpoint is None else f"from the {self.checkpoint.method} checkpoint"
        return {"method": self.method, "weights": f"float8_e4m3fn per output channel ({source})",
                "activations": "float8_e4m3fn per tensor (static)" if self.static_activations
                else "float8_e4m3fn per token (dynamic)", "lm_head": self.lm_head}


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8 [N, K], float32 scales [ceil(N / bn), ceil(K / bk)]), one per block."""
    bn, bk = block
    n, k = weight.shape
    padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight.float()
    tiles = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)
    q = to_fp8(tiles / scale[:, None, :, None]).view(padded.shape)[:n, :k].contiguous()
    return q, scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The float32 weight of block-scaled FP8 `q` (scale [ceil(N / bn), ceil(K / bk)])."""
    n, k = q.shape
    if scale.shape != (-(-n // block[0]), -(-k // block[1])):
        raise ValueError(f"block scales {tuple(scale.shape)} do not tile a weight {tuple(q.shape)} in blocks {block}")
    per_element = scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return q.float() * per_element


@dataclass(slots=True)
class LinearTensors:
    """Turns the checkpoint tensors of the FP8 linear layers into (attribute, tensor) pairs the layers load: a
    weight in high precision is quantized per channel; a block-wise weight waits for its block scales (or they
    for it) and both become a per-channel pair; a static input scale is kept only where activations are static."""

    scheme: Fp8Scheme
    waiting: dict[tuple[str, int, str], torch.Tensor] = field(default_factory=dict)

    def convert(self, layer: str, part: int, attr: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        block_scale = self.scheme.checkpoint is not None and self.scheme.checkpoint.weight_scales == "block"
        if attr == "weight" and tensor.dtype != FP8:
            return list(zip(("weight", "weight_scale"), quantize_rows(tensor)))
        if block_scale and attr in ("weight", BLOCK_SCALE):
            return self._pair(layer, part, attr, tensor)
        if attr == "input_scale":
            return [("input_scale", tensor)] if self.scheme.static_activations else []
        return [(attr, tensor)]

    def _pair(self, layer: str, part: int, attr: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        other = "weight" if attr != "weight" else BLOCK_SCALE
        mate = self.waiting.pop((layer, part, other), None)
        if mate is None:
            self.waiting[(layer, part, attr)] = tensor
            return []
        q, scale = (tensor, mate) if attr == "weight" else (mate, tensor)
        weight = dequantize_blocks(q, scale, self.scheme.checkpoint.block)
        return list(zip(("weight", "weight_scale"), quantize_rows(weight)))

    def unpaired(self) -> list[str]:
        return sorted(f"{layer} part {part}: {attr}" for layer, part, attr in self.waiting)
