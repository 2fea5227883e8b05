"""The KV cache's storage dtype (`--kv-cache-dtype`) and, for FP8, its per-layer scales and torch arithmetic.

FP8 pages hold `stored = fp8(clamp(k * (1 / k_scale), -max, max))` (round to nearest even) and are read as
`stored * k_scale`, one float32 scale per layer for K and one for V. The torch functions here are what the CPU
paths and the references compute; the Triton store kernel (`pdserve.kernels.fused`) computes the same numbers, and
the Triton attention kernels fold the scales into the softmax scale and the output.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

# --kv-cache-dtype values (SGLang's spelling): None keeps the model's dtype
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's storage dtype for `--kv-cache-dtype name` in a model computing in `model_dtype`."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def cuda_support_problem(dtype: torch.dtype, capability: tuple[int, int]) -> str | None:
    """Why the Triton kernels cannot store or read a KV cache of `dtype` on a GPU of this compute capability (E4M3
    needs Ada or Hopper, 8.9+; Triton converts E5M2 on older GPUs too), or None."""
    if dtype == torch.float8_e4m3fn and tuple(capability) < (8, 9):
        return (f"--kv-cache-dtype fp8_e4m3 needs compute capability 8.9 or newer (Ada, Hopper), the GPU has "
                f"{capability[0]}.{capability[1]}; use fp8_e5m2")
    return None


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 format (448 for E4M3, 57344 for E5M2)."""
    return float(torch.finfo(dtype).max)


def float32(value: float) -> float:
    """`value` rounded to the nearest float32, as a Python float (so it means the same on every device)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


@dataclass(frozen=True, slots=True)
class KVScales:
    """Per-layer float32 scales of an FP8 KV cache: layer i stores K / k[i] and reads it back times k[i]."""

    k: tuple[float, ...]
    v: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v):
            raise ValueError(f"{len(self.k)} K scales but {len(self.v)} V scales")
        for name, scales in (("k", self.k), ("v", self.v)):
            bad = [s for s in scales if isinstance(s, bool) or not isinstance(s, (int, float))
                   or not math.isfinite(s) or s <= 0]
            if bad:
                raise ValueError(f"{name} scales must be finite positive numbers, got {bad[0]!r}")
        object.__setattr__(self, "k", tuple(float32(s) for s in self.k))
        object.__setattr__(self, "v", tuple(float32(s) for s in self.v))

    @classmethod
    def ones(cls, num_layers: int) -> "KVScales":
        return cls((1.0,) * num_layers, (1.0,) * num_layers)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def describe(self) -> dict:
        return {"k_scales": list(self.k), "v_scales": list(self.v)}


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x (any float dtype) stored in FP8 `dtype` at `scale`: fp8(clamp(x * float32(1 / scale), -max, max))."""
    limit = fp8_max(dtype)
    return (x.float() * float32(1.0 / scale)).clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """FP8 values read back in float32: x * scale."""
    return x.float() * scale


def round_trip(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x as an FP8 cache of `dtype` at `scale` gives it back, in x's dtype."""
    return dequantize(quantize(x, scale, dtype), scale).to(x.dtype)


def copyable(t: torch.Tensor) -> torch.Tensor:
    """`t` as bytes when it is FP8 (torch's index_copy_ has no FP8 kernel on the CPU), else `t` itself."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def write_slots(cache: torch.Tensor, loc: torch.Tensor, values: torch.Tensor, scale: float) -> None:
    """cache[loc[t]] = values[t], quantized at `scale` when the cache is FP8 (else cast, scale 1)."""
    if is_fp8(cache.dtype):
        copyable(cache).index_copy_(0, loc, copyable(quantize(values, scale, cache.dtype)))
    else:
        cache.index_copy_(0, loc, values.to(cache.dtype))
