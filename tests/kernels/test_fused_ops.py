"""Fused ops vs their torch references: on CUDA (Triton path) and on CPU through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from paged_attention_reference import rel_err
from pdserve import kernels
from pdserve.kernels.ops import HAS_TRITON


def check_ops(device, dispatch, tokens=37, dtype=torch.bfloat16):
    """dispatch(name) -> the implementation under test; compares each with the torch reference."""
    gen = torch.Generator().manual_seed(tokens)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype).to(device)  # noqa: E731
    x, res, w = rnd(tokens, 1024), rnd(tokens, 1024), rnd(1024)
    out = dispatch("rmsnorm")(x, w, 1e-6)
    assert torch.equal(out, kernels.rmsnorm_ref(x, w, 1e-6)) or rel_err(out, kernels.rmsnorm_ref(x, w, 1e-6)) < 4e-3
    out, new_res = dispatch("rmsnorm")(x, w, 1e-6, residual=res)
    ref, ref_res = kernels.rmsnorm_ref(x, w, 1e-6, residual=res)
    assert torch.equal(new_res, ref_res) and rel_err(out, ref) < 4e-3

    qkv = rnd(tokens, 16 + 2 * 4, 128)  # per-head q/k norm on strided views of a fused qkv
    q_view, hw = qkv[:, :16], rnd(128)
    assert rel_err(dispatch("rmsnorm")(q_view, hw, 1e-6), kernels.rmsnorm_ref(q_view, hw, 1e-6)) < 4e-3

    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    cache = kernels.build_cos_sin_cache(inv_freq, 40000).to(device)
    positions = torch.randint(0, 40000, (tokens,), generator=gen).to(device)
    q_ref, k_ref = qkv[:, :16].clone(), qkv[:, 16:20].clone()
    kernels.apply_rotary_ref(positions, q_ref, k_ref, cache)
    untouched_v = qkv[:, 20:].clone()
    assert dispatch("apply_rotary")(positions, qkv[:, :16], qkv[:, 16:20], cache) is None
    assert rel_err(qkv[:, :16], q_ref) < 4e-3 and rel_err(qkv[:, 16:20], k_ref) < 4e-3
    assert torch.equal(qkv[:, 20:], untouched_v)

    gate_up = rnd(tokens, 2 * 3072)
    assert rel_err(dispatch("silu_and_mul")(gate_up), kernels.silu_and_mul_ref(gate_up)) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 37, 4096])
def test_fused_ops_cuda(tokens):
    assert HAS_TRITON
    check_ops("cuda", lambda name: getattr(kernels, name), tokens)


def test_fused_ops_cpu_fallback():
    check_ops("cpu", lambda name: getattr(kernels, name))


def test_fused_ops_triton_interpreter(interpreted):
    from pdserve.kernels import fused

    # fp32: Triton 3.6's interpreter rounds fp32 -> bf16 toward zero (seen 2026-11-21), the GPU does not
    check_ops("cpu", lambda name: getattr(fused, name), tokens=5, dtype=torch.float32)


# q heads, kv heads, head dim, per-head q/k norm, rotary dims: the attention shapes a layer hands the fused op
LAYER_SHAPES = {
    "llama-8b": (32, 8, 128, False, 128),
    "qwen3-0.6b": (16, 8, 128, True, 128),
    "gqa4-d64-norm": (8, 2, 64, True, 64),
    "mha-d64": (4, 4, 64, False, 64),
    "partial-rotary": (6, 2, 128, True, 64),
}
MAX_POSITION = 40000


class LayerInputs:
    """A qkv projection output split into q, k, v views, and a poisoned paged pool layer with random slots."""

    def __init__(self, shape, tokens, dtype, device, seed):
        hq, hkv, dim, qk_norm, rotary_dim = shape
        gen = torch.Generator().manual_seed(seed)
        rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype).to(device)  # noqa: E731
        self.hq, self.hkv, self.dim = hq, hkv, dim
        self.qkv = rnd(tokens, (hq + 2 * hkv) * dim)
        self.positions = torch.randint(0, MAX_POSITION, (tokens,), generator=gen).to(device)
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        self.cos_sin_cache = kernels.build_cos_sin_cache(inv_freq, MAX_POSITION).to(device)
        num_slots = 3 * tokens + 7
        self.loc = torch.randperm(num_slots, generator=gen)[:tokens].to(device)
        self.k_cache, self.v_cache = rnd(num_slots, hkv, dim), rnd(num_slots, hkv, dim)
        self.norm = dict(q_norm_weight=rnd(dim), k_norm_weight=rnd(dim), eps=1e-6) if qk_norm else {}

    def clone(self) -> LayerInputs:
        twin = object.__new__(LayerInputs)
        vars(twin).update(vars(self), qkv=self.qkv.clone(), k_cache=self.k_cache.clone(), v_cache=self.v_cache.clone())
        return twin

    def views(self):
        q, k, v = self.qkv.split([self.hq * self.dim, self.hkv * self.dim, self.hkv * self.dim], dim=-1)
        return q.view(-1, self.hq, self.dim), k.view(-1, self.hkv, self.dim), v.view(-1, self.hkv, self.dim)

    def run_fused(self, fn) -> None:
        q, k, v = self.views()
        fn(self.positions, q, k, v, self.cos_sin_cache, self.k_cache, self.v_cache, self.loc, **self.norm)

    def run_separate(self, rmsnorm, apply_rotary, store_kv) -> None:
        """The path the layer took before the fused op: norm each of q and k, rotate, store K/V."""
        q, k, v = self.views()
        if self.norm:
            q.copy_(rmsnorm(q, self.norm["q_norm_weight"], self.norm["eps"]))
            k.copy_(rmsnorm(k, self.norm["k_norm_weight"], self.norm["eps"]))
        apply_rotary(self.positions, q, k, self.cos_sin_cache)
        store_kv(k, v, self.k_cache, self.v_cache, self.loc)


def index_copy_store(k, v, k_cache, v_cache, loc):
    k_cache.index_copy_(0, loc, k)
    v_cache.index_copy_(0, loc, v)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest number of representable values between a and b elementwise (bf16 or fp32)."""
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[a.dtype]
    sign_mask = {torch.int16: 0x7FFF, torch.int32: 0x7FFFFFFF}[bits]

    def ordinal(x):
        i = x.view(bits).long()
        return torch.where(i >= 0, i, -(i & sign_mask))

    return int((ordinal(a) - ordinal(b)).abs().max()) if a.numel() else 0


def check_fused_layer_op(fused_fn, separate, inputs: LayerInputs, ref_tol: float, max_ulp: int):
    """fused_fn against the torch reference (rel. error) and against the separate kernels (ulps), and the pool:
    every slot in loc holds the rotated k and the untouched v; every other slot keeps its poison."""
    ref, before, sep, out = inputs.clone(), inputs.clone(), inputs.clone(), inputs
    assert out.run_fused(fused_fn) is None
    ref.run_fused(kernels.qk_norm_rope_store_kv_ref)
    sep.run_separate(*separate)
    q, k, v = out.views()
    q_ref, k_ref, _ = ref.views()
    assert rel_err(q, q_ref) <= ref_tol and rel_err(k, k_ref) <= ref_tol
    assert ulp_distance(out.qkv, sep.qkv) <= max_ulp
    assert torch.equal(v, before.views()[2])
    assert torch.equal(out.k_cache[out.loc], k) and torch.equal(out.v_cache[out.loc], v)
    unwritten = torch.ones(out.k_cache.shape[0], dtype=torch.bool, device=out.loc.device)
    unwritten[out.loc] = False
    assert torch.equal(out.k_cache[unwritten], before.k_cache[unwritten])
    assert torch.equal(out.v_cache[unwritten], before.v_cache[unwritten])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 37, 300])
@pytest.mark.parametrize("shape", list(LAYER_SHAPES))
def test_qk_norm_rope_store_kv_cuda(shape, tokens):
    """bf16: within 1 ulp of the separate rmsnorm, rotary and store_kv kernels the layer launched before."""
    from pdserve.kernels import fused
    from pdserve.kernels.attention import store_kv

    inputs = LayerInputs(LAYER_SHAPES[shape], tokens, torch.bfloat16, "cuda", seed=tokens)
    check_fused_layer_op(kernels.qk_norm_rope_store_kv, (fused.rmsnorm, fused.apply_rotary, store_kv), inputs,
                         ref_tol=4e-3, max_ulp=1)


@pytest.mark.parametrize("shape", list(LAYER_SHAPES))
def test_qk_norm_rope_store_kv_cpu_fallback(shape):
    inputs = LayerInputs(LAYER_SHAPES[shape], 37, torch.bfloat16, "cpu", seed=3)
    separate = (kernels.rmsnorm, kernels.apply_rotary, index_copy_store)
    check_fused_layer_op(kernels.qk_norm_rope_store_kv, separate, inputs, ref_tol=0.0, max_ulp=0)


@pytest.mark.parametrize("tokens", [1, 37, 260])
@pytest.mark.parametrize("shape", list(LAYER_SHAPES))
def test_qk_norm_rope_store_kv_triton_interpreter(interpreted, shape, tokens):
    from pdserve.kernels import fused
    from pdserve.kernels.attention import store_kv

    # fp32 for the interpreter's fp32 -> bf16 rounding (see test_fused_ops_triton_interpreter)
    inputs = LayerInputs(LAYER_SHAPES[shape], tokens, torch.float32, "cpu", seed=tokens)
    check_fused_layer_op(fused.qk_norm_rope_store_kv, (fused.rmsnorm, fused.apply_rotary, store_kv), inputs,
                         ref_tol=1e-6, max_ulp=1)


@pytest.mark.parametrize("shape", list(LAYER_SHAPES))
def test_qk_norm_rope_store_kv_bf16_triton_interpreter(interpreted, shape):
    """bf16 rounding after the norm and the rotation, as the separate kernels round (the interpreter truncates
    to bf16 in both, hence the loose tolerance against the torch reference)."""
    from pdserve.kernels import fused
    from pdserve.kernels.attention import store_kv

    inputs = LayerInputs(LAYER_SHAPES[shape], 37, torch.bfloat16, "cpu", seed=5)
    check_fused_layer_op(fused.qk_norm_rope_store_kv, (fused.rmsnorm, fused.apply_rotary, store_kv), inputs,
                         ref_tol=2e-2, max_ulp=1)
