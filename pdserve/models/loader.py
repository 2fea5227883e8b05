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
    files = checkpoint_files(model_path)
    for file in tqdm(files, desc="Loading safetensors", disable=not show_progress or len(files) < 2):
        with safe_open(str(file), framework="pt", device=device) as f:
            for hf_name in f.keys():
                name = _param_name(hf_name)
                if "rotary_emb" in name or kv_scale_target(name) is not None:  # KV scales: models/kv_scales.py
                    continue
                if model.config.tie_word_embeddings and name == "lm_head.weight":
                    continue
                _load_one(model, params, name, f.get_tensor(hf_name), loaded)
    expected = {n for n in params if not (model.config.tie_word_embeddings and n == "lm_head.weight")}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_path} lacks weights: {', '.join(missing[:8])}")


def _load_one(model, params: dict, name: str, tensor: torch.Tensor, loaded: set[str]) -> None:
    """Sharded layers keep their rank's slice of the full checkpoint tensor (`load_shard`); the rest copy it."""
    part = 0
    for hf_part, (fused, index) in model.packed_modules.items():
        if f".{hf_part}." in name:
            name, part = name.replace(f".{hf_part}.", f".{fused}."), index
            break
    if name not in params:
        raise ValueError(f"checkpoint weight {name!r} has no place in {type(model).__name__}")
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
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
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
    else:
        load_weights(model, Path(model_path))
    return model
