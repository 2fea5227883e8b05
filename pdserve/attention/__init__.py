"""Attention backends, chosen by --attention-backend."""

from __future__ import annotations

import importlib

from pdserve.attention.base import AttentionBackend

_BACKENDS = {
    "torch_native": "pdserve.attention.torch_native:TorchNativeBackend",
    "triton": "pdserve.attention.triton_backend:TritonAttnBackend",
    "sdpa": "pdserve.attention.sdpa_backend:SdpaAttnBackend",
}


def resolve_backend_name(name: str, device_type: str) -> str:
    if name != "auto":
        if name not in _BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}; choose from auto, {', '.join(_BACKENDS)}")
        return name
    if device_type != "cuda":
        return "torch_native"
    try:
        importlib.import_module("pdserve.attention.sdpa_backend")
        return "sdpa"  # torch SDPA for long prompts without a cached prefix, Triton for everything else
    except ImportError:
        return "torch_native"


def create_backend(name: str, **kwargs) -> AttentionBackend:
    module_name, cls_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)(**kwargs)


__all__ = ["AttentionBackend", "create_backend", "resolve_backend_name"]
