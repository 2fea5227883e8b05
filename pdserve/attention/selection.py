"""Which attention backend serves a model on a device: what each backend's kernels support, and the fallback.

Torch-free, so the choice is testable anywhere (the caller reads the GPU's compute capability and passes it in;
`flash_attn.cute`, which loads torch, is imported only once everything else lets flash_attn run);
`--attention-backend auto` (or a backend that cannot serve the model) ends with the first backend that can, with
one log line naming why.

`auto` on CUDA picks `flash_attn` where FlashAttention-4 is installed, the GPU is Hopper or newer and the model runs
in float16 or bfloat16: measured on H200 (2026-11-23, `benchmarks/results/2026-11-23/issue15/fa4_probe_h200.json`)
it is the fastest prefill at every shape tried (one 8k prompt 690 TFLOP/s against SDPA/cuDNN's 526; 16 prompts of
512 tokens 230 against the Triton extend kernel's 169; 2048 tokens after a 6144-token cached prefix 458 against
Triton's 333), and its decode is the Triton kernel's. Otherwise `sdpa` on CUDA, `torch_native` elsewhere. A KV cache
in another dtype than the model's (`--kv-cache-dtype fp8_e4m3`) rules FlashAttention-4 out: its kernels read K and V
in q's dtype only, where the Triton kernels, SDPA's (which round-trip K and V) and torch_native read FP8 pages.
"""

from __future__ import annotations

import importlib.util
import logging

logger = logging.getLogger(__name__)

BACKENDS = ("torch_native", "triton", "sdpa", "flash_attn")
FALLBACK = "torch_native"  # plain torch: any head size, page size and device
TRITON_BACKENDS = ("triton", "sdpa", "flash_attn")  # all three decode (and sdpa extends) on the Triton kernels
TRITON_HEAD_DIMS = (64, 128)  # the head sizes the Triton decode/extend kernels are built and tested for
FLASH_ATTN_MIN_CAPABILITY = (9, 0)  # FlashAttention-4's kernels: Hopper (SM90) and Blackwell
FLASH_ATTN_HEAD_DIMS = range(8, 257, 8)  # FlashAttention-4 on SM90: multiples of 8 from 8 to 256
FLASH_ATTN_DTYPES = ("float16", "bfloat16")
FLASH_ATTN_INSTALL = "pip install 'pdserve[flash-attn]'"


def unsupported_reason(name: str, head_dim: int, page_size: int, device_type: str = "cuda",
                       capability: tuple[int, int] | None = None, dtype: str | None = None,
                       kv_dtype: str | None = None) -> str | None:
    """Why backend `name` cannot serve a model with this head size and KV page size on this device (CUDA compute
    capability as (major, minor), None when unknown) in this dtype (torch's name: "bfloat16") with a KV cache in
    `kv_dtype` (None: the model's), or None when it can."""
    if name == "flash_attn" and (reason := flash_attn_reason(head_dim, device_type, capability, dtype,
                                                             kv_dtype)) is not None:
        return reason
    return triton_reason(head_dim, page_size) if name in TRITON_BACKENDS else None


def flash_attn_reason(head_dim: int, device_type: str, capability: tuple[int, int] | None,
                      dtype: str | None, kv_dtype: str | None = None) -> str | None:
    """What FlashAttention-4 itself needs (the decode on the Triton kernels is checked apart)."""
    reason = flash_attn_platform_reason(device_type, capability, dtype, kv_dtype)
    if reason is None and head_dim not in FLASH_ATTN_HEAD_DIMS:
        return f"FlashAttention-4 supports head_dim multiples of 8 from 8 to 256, the model has {head_dim}"
    return reason


def flash_attn_platform_reason(device_type: str, capability: tuple[int, int] | None, dtype: str | None,
                               kv_dtype: str | None = None) -> str | None:
    """Why FlashAttention-4 cannot run here in this dtype and KV dtype, whatever the model's shapes, or None."""
    if device_type != "cuda":
        return f"FlashAttention-4 runs on CUDA GPUs only, the device is {device_type}"
    if capability is None:
        return "FlashAttention-4 needs the GPU's compute capability, which was not given"
    if tuple(capability) < FLASH_ATTN_MIN_CAPABILITY:
        need, have = (".".join(map(str, c)) for c in (FLASH_ATTN_MIN_CAPABILITY, capability))
        return f"FlashAttention-4 needs compute capability {need} or newer, the GPU has {have}"
    if dtype not in FLASH_ATTN_DTYPES:
        return f"FlashAttention-4 computes in {' or '.join(FLASH_ATTN_DTYPES)}, the model runs in {dtype}"
    if kv_dtype not in (None, dtype):
        return f"FlashAttention-4 reads the KV cache in the model's dtype ({dtype}), not {kv_dtype}"
    return flash_attn_import_error()


def triton_reason(head_dim: int, page_size: int) -> str | None:
    if head_dim not in TRITON_HEAD_DIMS:
        supported = " and ".join(map(str, TRITON_HEAD_DIMS))
        return f"its Triton kernels support head_dim {supported}, the model has {head_dim}"
    if page_size < 1 or page_size & (page_size - 1):
        return f"its Triton kernels need a power-of-two page size, got {page_size}"
    if not triton_installed():
        return "triton is not installed"
    return None


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def flash_attn_installed() -> bool:
    """Whether `flash_attn.cute` can be found (found, not imported: importing it loads torch and CUTLASS)."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:  # no flash_attn package at all
        return False


def flash_attn_import_error() -> str | None:
    """Why `flash_attn.cute` cannot be imported, or None once it is (the backend imports it next anyway)."""
    if not flash_attn_installed():
        return f"flash_attn.cute (FlashAttention-4) is not installed ({FLASH_ATTN_INSTALL})"
    try:
        importlib.import_module("flash_attn.cute")
    except Exception as e:  # a broken install (a missing CUDA library, a version clash) is a reason, not a crash
        return f"flash_attn.cute (FlashAttention-4) does not import: {e!r}"
    return None


def auto_backend(device_type: str, capability: tuple[int, int] | None, dtype: str | None,
                 kv_dtype: str | None = None) -> str:
    if device_type != "cuda":
        return FALLBACK
    return "flash_attn" if flash_attn_platform_reason(device_type, capability, dtype, kv_dtype) is None else "sdpa"


def resolve_backend_name(name: str, device_type: str, head_dim: int, page_size: int,
                         capability: tuple[int, int] | None = None, dtype: str | None = None,
                         kv_dtype: str | None = None) -> str:
    """The backend to build for `--attention-backend name` on a device of `device_type` (with its CUDA compute
    capability) for a model running in `dtype` with its KV cache in `kv_dtype` (torch's name; None: `dtype`):
    `auto` as the module says; a backend whose kernels cannot serve the model falls back to torch_native (logged
    once)."""
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from auto, {', '.join(BACKENDS)}")
    chosen = name if name != "auto" else auto_backend(device_type, capability, dtype, kv_dtype)
    reason = unsupported_reason(chosen, head_dim, page_size, device_type, capability, dtype, kv_dtype)
    if reason is None:
        return chosen
    logger.warning("attention backend %s cannot serve this model (%s); using %s", chosen, reason, FALLBACK)
    return FALLBACK
