"""Fused ops and sampling with a Triton path on CUDA and a torch fallback everywhere else.

Attention kernels live in pdserve.kernels.attention (imports Triton; used by pdserve.attention.triton_backend).
"""

from pdserve.kernels.ops import (
    apply_rotary,
    apply_rotary_ref,
    build_cos_sin_cache,
    qk_norm_rope_store_kv,
    qk_norm_rope_store_kv_ref,
    quantize_tokens,
    rmsnorm,
    rmsnorm_ref,
    silu_and_mul,
    silu_and_mul_ref,
)
from pdserve.kernels.sampling import sample, top_k_top_p_min_p_candidates

__all__ = [
    "apply_rotary",
    "apply_rotary_ref",
    "build_cos_sin_cache",
    "qk_norm_rope_store_kv",
    "qk_norm_rope_store_kv_ref",
    "quantize_tokens",
    "rmsnorm",
    "rmsnorm_ref",
    "sample",
    "silu_and_mul",
    "silu_and_mul_ref",
    "top_k_top_p_min_p_candidates",
]
