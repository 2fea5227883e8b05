"""Which attention backend serves a model on a device: what each backend's kernels support, and the fallback.

Torch-free, so the choice is testable anywhere; `--attention-backend auto` (or a backend that cannot serve the
model) ends with the first backend that can, with one log line naming why.
"""

from __future__ import annotations

import importlib.util
import logging

logger = logging.getLogger(__name__)

BACKENDS = ("torch_native", "triton", "sdpa")
FALLBACK = "torch_native"  # plain torch: any head size, page size and device
TRITON_HEAD_DIMS = (64, 128)  # the head sizes the Triton decode/extend kernels are built and tested for


def unsupported_reason(name: str, head_dim: int, page_size: int) -> str | None:
    """Why backend `name` cannot serve a model with this head size and KV page size, or None when it can."""
    if name not in ("triton", "sdpa"):  # sdpa runs the Triton kernels for decode and cached prefixes
        return None
    if head_dim not in TRITON_HEAD_DIMS:
        return f"its Triton kernels support head_dim {' and '.join(map(str, TRITON_HEAD_DIMS))}, the model has {head_dim}"
    if page_size < 1 or page_size & (page_size - 1):
        return f"its Triton kernels need a power-of-two page size, got {page_size}"
    if not triton_installed():
        return "triton is not installed"
    return None


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend_name(name: str, device_type: str, head_dim: int, page_size: int) -> str:
    """The backend to build for `--attention-backend name`: `auto` picks sdpa on CUDA and torch_native elsewhere;
    a backend whose kernels cannot serve the model falls back to torch_native (logged once)."""
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from auto, {', '.join(BACKENDS)}")
    chosen = name if name != "auto" else ("sdpa" if device_type == "cuda" else FALLBACK)
    reason = unsupported_reason(chosen, head_dim, page_size)
    if reason is None:
        return chosen
    logger.warning("attention backend %s cannot serve this model (%s); using %s", chosen, reason, FALLBACK)
    return FALLBACK
