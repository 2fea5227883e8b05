"""Build a model and load its HF safetensors (single file or sharded with an index) straight to the device."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from pdserve.distributed.tensor_parallel import TPGroup
from pdserve.models import model_class
from pdserve.models.kv_scales import kv_scale_target
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.model_config import ModelConfig
from pdserve.quantization.formats import LinearTensors
from pdserve.quantization.fp8 import FP8, quantize_rows


def checkpoint_files(model_path: Path) -> list[Path]:
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_path / n for n in names]
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_path}")
    return files


def _param_name(hf_name: str) -> str:
    return hf_name.removeprefix("model.")


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup = TPGroup()
                ) -> LlamaForCausalLM:
    cls = model_class(cfg.architecture)
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = cls(cfg, tp)
        finally:
            torch.set_default_dtype(prev)
    # rotary caches stay float32 for accuracy
    for module in model.modules():
        for name in ("cos_sin_cache",):
            if hasattr(module, name):
                setattr(module, name, getattr(module, name).float())
    return model.eval()


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, model_path: Path, show_progress: bool = True) -> None:
    params = dict(model.named_parameters())
    device = str(next(iter(params.values())).device)  # tensors are read straight onto the model's device
    loaded: set[str] = set()
    fp8 = LinearTensors(model.config.quantization) if model.config.quantization is not None else None
    head_copies_embedding = model.config.tie_word_embeddings and model.lm_head.weight is not model.embed_tokens.weight
    files = checkpoint_files(model_path)
    for file in tqdm(files, desc="Loading safetensors", disable=not show_progress or len(files) < 2):
        with safe_open(str(file), framework="pt", device=device) as f:
            for hf_name in f.keys():
                name = _param_name(hf_name)
                if "rotary_emb" in name or kv_scale_target(name) is not None:  # KV scales: models/kv_scales.py
                    continue
                if model.config.tie_word_embeddings and name == "lm_head.weight":
                    continue
                tensor = f.get_tensor(hf_name)
                _load_one(model, params, name, tensor, loaded, fp8)
                if head_copies_embedding and name == "embed_tokens.weight":
                    _load_one(model, params, "lm_head.weight", tensor, loaded, fp8)
    expected = {n for n in params if not (model.config.tie_word_embeddings and n == "lm_head.weight")}
    missing = sorted(expected - loaded) + (fp8.unpaired() if fp8 is not None else [])
    if missing:
        raise ValueError(f"checkpoint {model_path} lacks weights: {', '.join(missing[:8])}")


def _load_one(model, params: dict, name: str, tensor: torch.Tensor, loaded: set[str],
              fp8: LinearTensors | None) -> None:
    """Sharded layers keep their rank's slice of the full checkpoint tensor (`load_shard`); the rest copy it.
    An FP8 layer's tensors go through `fp8` first (quantized, paired or dropped there)."""
    part = 0
    for hf_part, (fused, index) in model.packed_modules.items():
        if f".{hf_part}." in name:
            name, part = name.replace(f".{hf_part}.", f".{fused}."), index
            break
    module_name, _, attr = name.rpartition(".")
    module = _submodule(model, module_name)
    if getattr(module, "weight_scale", None) is not None:
        for fp8_attr, fp8_tensor in fp8.convert(module_name, part, attr, tensor):
            _load_param(module, params, f"{module_name}.{fp8_attr}", fp8_tensor, part, loaded)
        return
    if tensor.dtype == FP8:
        hint = " (an FP8 LM head needs --quantize-lm-head)" if module_name == "lm_head" else ""
        raise ValueError(f"checkpoint weight {name!r} is FP8 but its layer is not{hint}")
    _load_param(module, params, name, tensor, part, loaded)


def _submodule(model, name: str):
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _load_param(module, params: dict, name: str, tensor: torch.Tensor, part: int, loaded: set[str]) -> None:
    if name not in params:
        raise ValueError(f"checkpoint weight {name!r} has no place in the model")
    attr = name.rpartition(".")[2]
    if hasattr(module, "load_shard"):
        module.load_shard(attr, tensor, part)
        loaded.add(name)
        return
    target = params[name]
    if target.shape != tensor.shape:
        raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(target.shape)}")
    target.data.copy_(tensor)
    loaded.add(name)


def load_model(model_path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               dummy: bool = False, tp: TPGroup = TPGroup()) -> LlamaForCausalLM:
    model = build_model(cfg, dtype, device, tp)
    if dummy:
        fill_random(model)
    else:
        load_weights(model, Path(model_path))
    if device.type == "cuda":  # what loading left in the allocator's cache would count as used by the weights
        torch.cuda.empty_cache()
    return model


@torch.no_grad()
def fill_random(model: LlamaForCausalLM, std: float = 0.02) -> None:
    """Random weights (benchmarks): normal(0, std), an FP8 layer's quantized per channel as a checkpoint's would be."""
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if name == "weight" and p.dtype == FP8:
                weight, scale = quantize_rows(torch.empty(p.shape, device=p.device).normal_(0.0, std))
                p.copy_(weight)
                module.weight_scale.copy_(scale)
            elif name == "input_scale":
                p.fill_(1.0)
            elif name != "weight_scale":
                p.normal_(0.0, std)
