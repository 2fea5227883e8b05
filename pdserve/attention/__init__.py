"""Attention backends, chosen by --attention-backend (see `selection.py`)."""

from __future__ import annotations

import importlib

from pdserve.attention.base import AttentionBackend
from pdserve.attention.selection import resolve_backend_name

_BACKENDS = {
    "torch_native": "pdserve.attention.torch_native:TorchNativeBackend",
    "triton": "pdserve.attention.triton_backend:TritonAttnBackend",
    "sdpa": "pdserve.attention.sdpa_backend:SdpaAttnBackend",
    "flash_attn": "pdserve.attention.flash_attn_backend:FlashAttnBackend",
}


def create_backend(name: str, **kwargs) -> AttentionBackend:
    module_name, cls_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)(**kwargs)


__all__ = ["AttentionBackend", "create_backend", "resolve_backend_name"]
