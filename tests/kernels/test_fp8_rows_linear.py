"""The FP8 rows kernel (a decode batch's rows times an FP8 weight on the FP8 MMA, rows quantized in the kernel or
before it) gives what quantize + GEMM gives: the same quantized operands, float32 sums in another order (CPU
interpreter and GPU); `fp8_linear` routes a batch's rows to it only where the tuner chose it."""

from __future__ import annotations

import dataclasses

import pytest
import sm90_compile
import torch
from fp8_kinds import ROW_SHAPE_CANDIDATES, one_candidate_of_each_kind

from pdserve.kernels import ops, skinny
from pdserve.kernels.fp8_rows import quantize_tokens_ref
from pdserve.kernels.rope_store import RopeStore
from pdserve.quantization import fp8

IN_KERNEL = fp8.Fp8RowsConfig(16, 32, 4, 1, True)
QUANTIZED_FIRST = fp8.Fp8RowsConfig(32, 64, 4, 1, False)
IN_KERNEL_SPLIT = fp8.Fp8RowsConfig(16, 32, 4, 1, True, 3)
QUANTIZED_FIRST_SPLIT = fp8.Fp8RowsConfig(16, 64, 4, 1, False, 2)


@pytest.fixture(autouse=True)
def seeded():
    """`fp8.pending_norm` draws its residual and norm weight from torch's global generator: the same values each run,
    whatever ran before (a 1e-6 check of them failed once after other test files had drawn)."""
    torch.manual_seed(0)


def operands(m: int, n: int, k: int, device: str = "cpu", dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, m)[:, None]
    if m > 2:
        x[1] = 0.0  # an all-zero row: the smallest scale
    w_q, w_scale = fp8.quantize_rows(torch.randn(n, k, generator=gen))
    bias = torch.randn(n, generator=gen)
    return x.to(device, dtype), w_q.to(device), w_scale.to(device), bias.to(device, dtype)


def assert_close_to_quantized_linear(x, w_q, w_scale, bias, cfg, tolerance: float):
    """Against the float64 product of the same quantized operands (`torch._scaled_mm`, the GEMM of more rows, is
    no reference here: it rounds to bf16 before an fp16 output)."""
    for static in (None, torch.tensor(0.02, device=x.device)):
        x_q, x_scale = quantize_tokens_ref(x, static)
        exact = (x_q.double() * x_scale.double()) @ (w_q.double() * w_scale.double()[:, None]).t() + bias.double()
        got = fp8.fp8_rows_linear(x, w_q, w_scale, static, bias, cfg).double()
        assert torch.equal(fp8.quantize_tokens(x, static)[0].view(torch.uint8), x_q.view(torch.uint8))
        assert ((got - exact).norm(dim=1) <= tolerance * exact.norm(dim=1)).all(), (got - exact).abs().max()


@pytest.mark.parametrize("m, n, k, cfg", [
    (1, 48, 64, IN_KERNEL), (3, 40, 96, IN_KERNEL), (4, 48, 64, QUANTIZED_FIRST),
    (17, 40, 200, QUANTIZED_FIRST), (3, 40, 200, IN_KERNEL_SPLIT), (5, 48, 256, QUANTIZED_FIRST_SPLIT),
    (8, 32, 2100, IN_KERNEL),  # an amax pass of 2048 + 52 columns
])
def test_fp8_rows_kernel_matches_quantized_linear_interpreted(interpreted, m, n, k, cfg):
    """Split K included (K = 200 in splits of 96, 96 and 8): the last program of a column block adds the partials
    and leaves the counters zero for the next launch."""
    x, w_q, w_scale, bias = operands(m, n, k)
    assert_close_to_quantized_linear(x, w_q, w_scale, bias, cfg, tolerance=1e-6)
    assert not fp8.split_counters(x.device).any()


def assert_pending_norm_matches_the_norm_kernel_first(pending, w_q, w_scale, bias, cfg, tolerance: float):
    """The rows kernel computing pending RMSNorm rows itself gives the product of the rows the RMSNorm kernel (or
    torch) computes and quantizes, against float64 (only float32 sums differ, the sum of squares among them), and
    writes x + residual for the next layer."""
    evaluated = pending.evaluate()
    exact = ((evaluated.values.double() * evaluated.scale.double()) @ (w_q.double() * w_scale.double()[:, None]).t()
             + bias.double())
    expected_residual = pending.residual_out.clone()
    pending.residual_out.fill_(float("nan"))
    got = fp8.fp8_rows_linear(pending, w_q, w_scale, None, bias, cfg).double()
    assert ((got - exact).norm(dim=1) <= tolerance * exact.norm(dim=1)).all(), (got - exact).abs().max()
    assert torch.equal(pending.residual_out, expected_residual)


@pytest.mark.parametrize("m, n, k, cfg", [
    (1, 48, 64, IN_KERNEL), (3, 40, 96, IN_KERNEL), (3, 40, 200, IN_KERNEL_SPLIT),
    (8, 32, 2100, IN_KERNEL),  # a row in two blocks: the sum of squares and the amax each a pass of their own
])
def test_rows_kernel_computes_pending_norm_rows_interpreted(interpreted, m, n, k, cfg):
    x, w_q, w_scale, bias = operands(m, n, k)
    assert_pending_norm_matches_the_norm_kernel_first(fp8.pending_norm(x), w_q, w_scale, bias, cfg, 1e-6)


def silu_and_mul_exact(product: torch.Tensor) -> torch.Tensor:
    gate, up = product.double().chunk(2, dim=1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # SiLU of large negative gates
@pytest.mark.parametrize("m, n, k, cfg, pending", [
    (1, 48, 64, IN_KERNEL, True), (3, 40, 96, IN_KERNEL, False), (2, 40, 200, IN_KERNEL_SPLIT, True),
    (4, 48, 64, QUANTIZED_FIRST, False), (5, 40, 256, QUANTIZED_FIRST_SPLIT, False),
])
def test_rows_kernel_computes_silu_and_mul_interpreted(interpreted, m, n, k, cfg, pending):
    """gated: the kernel's SiLU(gate) * up of the [gate; up] product, half the columns (40: a last block of gate
    and up rows cut short), against float64 of the same quantized operands; pending RMSNorm rows too."""
    x, w_q, w_scale, _ = operands(m, n, k)
    rows = fp8.pending_norm(x) if pending else x
    quantized = rows.evaluate() if pending else fp8.Fp8Rows(*quantize_tokens_ref(x), x.dtype)
    exact = silu_and_mul_exact((quantized.values.double() * quantized.scale.double())
                               @ (w_q.double() * w_scale.double()[:, None]).t())
    got = fp8.fp8_rows_linear(rows, w_q, w_scale, None, None, cfg, gated=True).values
    assert got.shape == (m, n // 2)
    assert ((got.double() - exact).norm(dim=1) <= 1e-6 * exact.norm(dim=1)).all(), (got - exact).abs().max()
    assert not fp8.split_counters(x.device).any()


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("m, n, k, cfg", [(1, 48, 64, IN_KERNEL), (2, 40, 200, IN_KERNEL_SPLIT),
                                          (4, 40, 96, QUANTIZED_FIRST)])
def test_gated_kernel_leaves_each_rows_amax_in_parts_interpreted(interpreted, m, n, k, cfg):
    """Part j of a row: the amax of the row's rounded SiLU(gate) * up over columns [j * block_n / 2, +block_n / 2)
    (n = 40: 20 columns, a last part cut short where block_n / 2 does not divide them)."""
    x, w_q, w_scale, _ = operands(m, n, k)
    got = fp8.fp8_rows_linear(x, w_q, w_scale, None, None, cfg, gated=True)
    blocks = got.values.split(cfg.block_n // 2, dim=1)
    assert got.amax_parts.shape == (m, len(blocks))
    assert torch.equal(got.amax_parts, torch.stack([b.abs().amax(dim=1) for b in blocks], dim=1))


@pytest.mark.parametrize("m, n, k, cfg, part", [
    (1, 48, 64, IN_KERNEL, 32), (3, 40, 200, IN_KERNEL_SPLIT, 16), (2, 32, 2100, IN_KERNEL, 32),
    (3, 48, 96, QUANTIZED_FIRST, 32),  # quantized before the kernel: the parts go unread
])
def test_rows_kernel_reads_the_amax_parts_interpreted(interpreted, m, n, k, cfg, part):
    """Rows with their amax in parts give the bytes the kernel's own amax pass gives (a max is exact in any order),
    parts of a static-scale layer go unread; parts that lie are believed (so the kernel did read them)."""
    x, w_q, w_scale, bias = operands(m, n, k)
    rows = fp8.rows_with_amax(x, part)
    assert rows.amax_parts.shape == (m, -(-k // part))
    for static in (None, torch.tensor(0.02)):
        expected = fp8.fp8_rows_linear(x, w_q, w_scale, static, bias, cfg)
        assert torch.equal(fp8.fp8_rows_linear(rows, w_q, w_scale, static, bias, cfg), expected)
    tripled = fp8.fp8_rows_linear(fp8.RowsWithAmax(x, rows.amax_parts * 3), w_q, w_scale, None, bias, cfg)
    assert torch.equal(tripled, fp8.fp8_rows_linear(x, w_q, w_scale, None, bias, cfg)) != cfg.quantize_in_kernel


def rope_sample(m: int, kv_dtype: torch.dtype) -> RopeStore:
    """4 q heads, 2 kv heads of 32; rows at positions 5, 9, 0 stored into slots 3, 0, 7 of 8."""
    gen = torch.Generator().manual_seed(7)
    cache = torch.zeros(8, 2, 32).to(kv_dtype)
    return RopeStore(torch.tensor([5, 9, 0][:m]), torch.tensor([3, 0, 7][:m]), torch.randn(16, 32, generator=gen),
                     cache, cache.clone(), 0.5, 2.0, 4, 2, 32)


@pytest.mark.parametrize("m, cfg, pending, kv_dtype", [
    (1, IN_KERNEL, True, torch.float32), (3, IN_KERNEL_SPLIT, False, torch.float32),
    (2, QUANTIZED_FIRST, False, torch.float8_e4m3fn), (3, IN_KERNEL, True, torch.bfloat16),
])
def test_rows_kernel_does_the_rotary_and_the_kv_store_interpreted(fp8_interpreted, m, cfg, pending, kv_dtype):
    """rope: the qkv rows with q and k rotated at their positions, and k and v in the cache at their slots (an FP8
    cache at the layer's scales), as `RopeStore.apply` after the product leaves them."""
    x, w_q, w_scale, bias = operands(m, 256, 64)
    rows = fp8.pending_norm(x) if pending else x
    rope, expected_rope = rope_sample(m, kv_dtype), rope_sample(m, kv_dtype)
    plain = rows.evaluate() if pending else x
    plain_cfg = fp8.Fp8RowsConfig(cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, False, cfg.split_k)
    expected = expected_rope.apply(fp8.fp8_rows_linear(plain, w_q, w_scale, None, bias, plain_cfg))
    got = fp8.fp8_rows_linear(rows, w_q, w_scale, None, bias, cfg, rope=rope)
    assert ((got - expected).norm(dim=1) <= 1e-6 * expected.norm(dim=1)).all(), (got - expected).abs().max()
    step = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float8_e4m3fn: 2**-3}[kv_dtype]  # one rounding apart
    for cache, expected_cache in ((rope.k_cache, expected_rope.k_cache), (rope.v_cache, expected_rope.v_cache)):
        difference = (cache.float() - expected_cache.float()).abs()
        assert (difference <= 1e-6 + step * expected_cache.float().abs()).all()
        assert expected_cache.float().abs().sum(dim=(1, 2)).nonzero().flatten().tolist() == sorted(rope.loc.tolist())


def test_only_few_rows_are_quantized_in_the_kernel():
    assert any(cfg.quantize_in_kernel for cfg in fp8.fp8_candidates(fp8.FP8_IN_KERNEL_ROWS))
    assert not any(cfg.quantize_in_kernel for cfg in fp8.fp8_candidates(fp8.FP8_IN_KERNEL_ROWS + 1))
    assert fp8.fp8_candidates(fp8.FP8_MAX_ROWS)


def test_candidates_fit_shared_memory_at_their_row_count():
    """A 64 x 512 weight block over 4 stages fits beside one row's blocks, not beside 64 rows' (256 KiB in all)."""
    deep = fp8.Fp8RowsConfig(64, 512, 4, 4, False, 1)
    assert deep in fp8.FP8_CANDIDATES and deep in fp8.fp8_candidates(1) and deep not in fp8.fp8_candidates(64)
    for rows in (1, 9, 33, fp8.FP8_MAX_ROWS):
        padded = 1 << (rows - 1).bit_length()
        assert all((c.num_stages + (padded <= 8)) * c.block_k * (c.block_n + padded * (1 + c.quantize_in_kernel))
                   <= fp8.HOPPER_SHARED_MEMORY for c in fp8.fp8_candidates(rows))


def test_fp8_linear_routes_rows_by_the_tuned_choice(monkeypatch):
    x, w_q, w_scale, _ = operands(3, 48, 32)
    calls = []
    def rows_kernel(x, *args):  # recorded, computed by quantize + GEMM
        calls.append((x, *args))
        return fp8.quantized_linear(x.evaluate() if hasattr(x, "evaluate") else x, *args[:4])

    monkeypatch.setattr(fp8, "fp8_rows_linear", rows_kernel)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # as on a GPU, computed on the CPU
    monkeypatch.setattr(ops, "_use_triton", lambda x: False)
    monkeypatch.setattr(fp8, "quantize_tokens", quantize_tokens_ref)
    monkeypatch.setattr(fp8, "has_fp8_gemm", lambda device: False)
    monkeypatch.setitem(skinny._choice, (3, 48, 32, fp8.FP8, x.dtype, None), fp8.FP8_CANDIDATES[0])
    assert torch.equal(fp8.fp8_linear(x, w_q, w_scale), fp8.quantized_linear(x, w_q, w_scale, None, None))
    assert len(calls) == 1 and calls[0][-1] == fp8.FP8_CANDIDATES[0]
    fp8.fp8_linear(torch.randn(4, 32), w_q, w_scale)  # 4 rows were not tuned: quantize + GEMM
    assert len(calls) == 1
    rows = fp8.Fp8Rows(*quantize_tokens_ref(x), x.dtype)  # quantized by the kernel before: tuned apart
    assert torch.equal(fp8.fp8_linear(rows, w_q, w_scale), fp8.quantized_linear(x, w_q, w_scale, None, None))
    assert len(calls) == 1
    monkeypatch.setitem(skinny._choice, (3, 48, 32, fp8.FP8, fp8.FP8, None), fp8.FP8_CANDIDATES[1])
    assert torch.equal(fp8.fp8_linear(rows, w_q, w_scale), fp8.quantized_linear(x, w_q, w_scale, None, None))
    assert len(calls) == 2 and calls[1][0] is rows and calls[1][-1] == fp8.FP8_CANDIDATES[1]
    pending = fp8.pending_norm(x)  # not chosen for pending rows: the RMSNorm first, then routed as Fp8Rows
    assert torch.equal(fp8.fp8_linear(pending, w_q, w_scale), fp8.quantized_linear(pending.evaluate(), w_q, w_scale,
                                                                                    None, None))
    assert len(calls) == 3 and isinstance(calls[2][0], fp8.Fp8Rows)
    monkeypatch.setitem(skinny._choice, (3, 48, 32, fp8.FP8, "rmsnorm", None), fp8.FP8_CANDIDATES[0])
    fp8.fp8_linear(pending, w_q, w_scale)
    assert len(calls) == 4 and calls[3][0] is pending
    with_amax = fp8.rows_with_amax(x)  # not chosen for rows with amax parts: routed as the rows themselves
    assert torch.equal(fp8.fp8_linear(with_amax, w_q, w_scale), fp8.quantized_linear(x, w_q, w_scale, None, None))
    assert len(calls) == 5 and calls[4][0] is x and calls[4][-1] == fp8.FP8_CANDIDATES[0]
    monkeypatch.setitem(skinny._choice, (3, 48, 32, fp8.FP8, "amax_parts", None), IN_KERNEL)
    fp8.fp8_linear(with_amax, w_q, w_scale)
    assert len(calls) == 6 and calls[5][0] is with_amax and calls[5][-1] == IN_KERNEL


def test_gated_linear_routes_rows_by_the_tuned_choice(monkeypatch):
    """SiLU(gate) * up: the product as `fp8_linear` routes it, then the SiLU-and-mul kernel; where the kernel
    computing it was chosen for the rows, that kernel (pending RMSNorm rows evaluated first for a config that does
    not quantize in the kernel)."""
    x, w_q, w_scale, _ = operands(3, 48, 32)
    pending = fp8.pending_norm(x)
    calls = []

    def rows_kernel(x, *args, gated=False):  # recorded, computed by quantize + GEMM
        calls.append((x, args[-1], gated))
        out = fp8.quantized_linear(x.evaluate() if hasattr(x, "evaluate") else x, *args[:4])
        return ops.silu_and_mul(out) if gated else out

    monkeypatch.setattr(fp8, "fp8_rows_linear", rows_kernel)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(ops, "_use_triton", lambda x: False)
    monkeypatch.setattr(fp8, "quantize_tokens", quantize_tokens_ref)
    monkeypatch.setattr(fp8, "has_fp8_gemm", lambda device: False)
    expected = ops.silu_and_mul(fp8.quantized_linear(pending.evaluate(), w_q, w_scale, None, None))
    assert torch.equal(fp8.fp8_gated_linear(pending, w_q, w_scale), expected) and not calls
    monkeypatch.setitem(skinny._choice, (3, 48, 32, fp8.FP8, "rmsnorm", "silu_and_mul"), IN_KERNEL)
    assert torch.equal(fp8.fp8_gated_linear(pending, w_q, w_scale), expected)
    assert calls[-1] == (pending, IN_KERNEL, True)
    monkeypatch.setitem(skinny._choice, (3, 48, 32, fp8.FP8, "rmsnorm", "silu_and_mul"), QUANTIZED_FIRST)
    assert torch.equal(fp8.fp8_gated_linear(pending, w_q, w_scale), expected)
    assert isinstance(calls[-1][0], fp8.Fp8Rows) and calls[-1][1:] == (QUANTIZED_FIRST, True)
    assert len(calls) == 2


def assert_rotary_and_store_as_applied(rows, w_q, w_scale, bias, cfg):
    """On the GPU: the rows kernel's rotary and KV store (bf16 and FP8 caches) against `RopeStore.apply` after the
    same kernel's product: the same qkv rows and cache bytes up to one rounding of the float32 arithmetic."""
    m, device = rows.shape[0], w_q.device
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        sample = RopeStore.sample(m, 32, 8, 128, kv_dtype, device)
        fused, applied = (dataclasses.replace(sample, k_cache=torch.zeros_like(sample.k_cache),
                                              v_cache=torch.zeros_like(sample.v_cache), k_scale=0.5, v_scale=2.0)
                          for _ in range(2))
        plain = rows.evaluate() if cfg.quantize_in_kernel else rows
        plain_cfg = fp8.Fp8RowsConfig(cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, False, cfg.split_k)
        expected = applied.apply(fp8.fp8_rows_linear(plain, w_q, w_scale, None, bias, plain_cfg)).float()
        got = fp8.fp8_rows_linear(rows, w_q, w_scale, None, bias, cfg, rope=fused).float()
        assert ((got - expected).abs() <= 2**-7 * expected.abs() + 1e-6).all()
        step = 2**-7 if kv_dtype == torch.bfloat16 else 2**-3
        for cache, expected_cache in ((fused.k_cache, applied.k_cache), (fused.v_cache, applied.v_cache)):
            assert ((cache.float() - expected_cache.float()).abs() <= step * expected_cache.float().abs() + 1e-6).all()


GPU_SHAPES = ((1, 4096, 4096), (3, 6144, 4096), (16, 4096, 14336), (64, 6144, 4096))


def assert_rows_kernel_on_gpu(dtype: torch.dtype, candidates, inputs: bool = True) -> None:
    """On the GPU the MMA's partial sums are promoted to float32 every PROMOTE_K products: float32-level error,
    then the 16-bit output's rounding; split-K launches leave the counters zero. `candidates(rows)`: the configs
    checked at that many rows; `inputs`: also with rows pending RMSNorm or with their amax, and the fused
    epilogues (each a compile of its own)."""
    for m, n, k in GPU_SHAPES:
        x, w_q, w_scale, bias = operands(m, n, k, "cuda", dtype)
        for cfg in candidates(m):
            assert_close_to_quantized_linear(x, w_q, w_scale, bias, cfg, tolerance=4e-3)
            if not inputs:
                continue
            if cfg.quantize_in_kernel:
                assert_pending_norm_matches_the_norm_kernel_first(fp8.pending_norm(x), w_q, w_scale, bias, cfg, 4e-3)
                assert torch.equal(fp8.fp8_rows_linear(fp8.rows_with_amax(x), w_q, w_scale, None, bias, cfg),
                                   fp8.fp8_rows_linear(x, w_q, w_scale, None, bias, cfg))
            if m <= fp8.FUSED_SILU_ROWS and cfg in ROW_SHAPE_CANDIDATES:
                rows = fp8.pending_norm(x) if cfg.quantize_in_kernel else x
                quantized = rows.evaluate() if cfg.quantize_in_kernel else fp8.Fp8Rows(*fp8.quantize_tokens(x), dtype)
                exact = silu_and_mul_exact((quantized.values.double() * quantized.scale.double())
                                           @ (w_q.double() * w_scale.double()[:, None]).t())
                got = fp8.fp8_rows_linear(rows, w_q, w_scale, None, None, cfg, gated=True)
                assert torch.equal(got.amax_parts, torch.stack([b.abs().amax(dim=1).float() for b in
                                                                got.values.split(cfg.block_n // 2, dim=1)], dim=1))
                got = got.values.double()
                assert ((got - exact).norm(dim=1) <= 4e-3 * exact.norm(dim=1)).all()
                if n == 6144:  # llama-3.1-8b's qkv: 32 q heads, 8 kv heads of 128
                    assert_rotary_and_store_as_applied(rows, w_q, w_scale, bias, cfg)
    assert not fp8.split_counters(x.device).any()


@pytest.mark.fp8_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_rows_on_gpu(dtype):
    """One candidate of each kind at each shape; Fp8Rows as a RMSNorm hands them over take the routed linear. The
    kinds of rows and the fused epilogues in bf16, the models' dtype; in fp16 the product (each is another compile
    of every config: fp16's are in the sweep below)."""
    assert_rows_kernel_on_gpu(dtype, one_candidate_of_each_kind, inputs=dtype == torch.bfloat16)
    x, w_q, w_scale, bias = operands(*GPU_SHAPES[-1], "cuda", dtype)
    x_q, x_scale = fp8.quantize_tokens(x)
    got = fp8.fp8_linear(fp8.Fp8Rows(x_q, x_scale, dtype), w_q, w_scale, None, bias)
    exact = (x_q.double() * x_scale.double()) @ (w_q.double() * w_scale.double()[:, None]).t() + bias.double()
    assert got.dtype == dtype and ((got.double() - exact).norm(dim=1) <= 4e-3 * exact.norm(dim=1)).all()


@pytest.mark.tuner_sweep
@pytest.mark.fp8_gpu
@pytest.mark.timeout(520)  # on a cold Triton cache each config compiles for every shape and epilogue
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_fp8_rows_candidate_on_gpu_and_tuner_choice(dtype):
    """Every candidate at each shape (each compiles: minutes), then the tuner over llama-3.1-8b's qkv and down
    shapes with every epilogue it times."""
    assert_rows_kernel_on_gpu(dtype, fp8.fp8_candidates)
    _, w_q, w_scale, _ = operands(*GPU_SHAPES[-1], "cuda", dtype)
    down = fp8.quantize_rows(torch.randn(4096, 3072, device="cuda"))  # after a [6144, 4096] gated weight
    report = fp8.tune_fp8_rows([1, 4, 64, 65], [(w_q, w_scale), down], dtype, gated=[w_q],
                               rotary=[(w_q, 32, 8, 128)], kv_dtype=torch.float8_e4m3fn, amax_parts=[(down[0], 32)])
    tuned = {(m, *shape) for m in (1, 4, 64) for shape in ((6144, 4096), (4096, 3072))}  # 65 > FP8_MAX_ROWS
    # model-dtype rows, Fp8Rows, and up to FUSED_NORM_ROWS (FUSED_SILU_ROWS, FUSED_ROPE_ROWS) rows pending RMSNorm
    # rows (their SiLU-and-mul, their rotary and KV store; the down projection's rows with their amax parts)
    assert set(report) == (tuned | {(*shape, "quantized") for shape in tuned}
                           | {(1, n, k, "rmsnorm") for n, k in ((6144, 4096), (4096, 3072))}
                           | {(1, 6144, 4096, epilogue) for epilogue in ("silu_and_mul", "rope_store")}
                           | {(1, 4096, 3072, "amax_parts")})
    assert all(reference > 0 and best > 0 for reference, best in report.values())


ROWS_KERNEL_CONSTANTS = dict(FP8_MAX=448.0, INV_FP8_MAX=1 / 448, MIN_SCALE=1e-12, QUANTIZE=True, STATIC=False,
                             HW_CAST=True, ROWS=1, BLOCK_N=64, BLOCK_K=256, HAS_BIAS=False, EVEN_K=True, PROMOTE_K=32,
                             SPLIT_K=4, AMAX_BLOCK=4096, ONE_BLOCK=True, GATED=False, ROPE=False, HEADS_Q=1,
                             HEADS_KV=1, HALF=1, KV_QUANT=False, KV_FP8_MAX=0.0, PARTS=0, PRELOAD=True, PDL=False)


def rows_kernel_for_sm90(constants: dict, num_warps: int = 4, num_stages: int = 4, x_dtype: str = "*bf16"):
    """The FP8 rows kernel with these constants, compiled for sm_90 with Triton's own ptxas (no GPU needed); the
    weight rows and the row length aligned to 16 bytes, as llama's launches specialize them."""
    from sm90_compile import compile_for_sm90

    from pdserve.quantization.fp8_triton import fp8_rows_kernel

    pointers = dict(X=x_dtype, XScale="*fp32", W="*fp8e4nv", WScale="*fp32", StaticScale="*fp32", B="*fp32",
                    Out="*bf16", Partial="*fp32", Counters="*i32", Residual="*bf16", NormWeight="*bf16",
                    ResidualOut="*bf16", Pos="*i64", Loc="*i64", CosSin="*fp32", KCache="*bf16", VCache="*bf16",
                    AmaxParts="*fp32", AmaxOut="*fp32")
    return compile_for_sm90(fp8_rows_kernel, pointers, dict(ROWS_KERNEL_CONSTANTS, **constants),
                            ("eps", "k_inv_scale", "v_inv_scale"),
                            [*pointers, "stride_wn", "K_SPLIT", "K", "stride_xm"], num_warps, num_stages)


def rows_kernel_ptx_for_sm90(norm: bool) -> str:
    """The rows kernel computing pending RMSNorm rows itself or not."""
    return rows_kernel_for_sm90(dict(NORM=norm)).asm["ptx"]


@sm90_compile.needs_ptxas
@pytest.mark.parametrize("rows", [8, 64])
def test_every_candidate_fits_shared_memory_as_compiled(rows):
    """The shared memory each candidate takes when compiled for sm_90 at its row counts' extremes (the most rows
    that preload a weight block, the most rows at all) is within a Hopper SM's: `fp8_candidates` counts it right."""
    for cfg in fp8.fp8_candidates(rows):
        constants = dict(ROWS=rows, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, NORM=False,
                         QUANTIZE=cfg.quantize_in_kernel, PRELOAD=fp8.preloads(rows))
        kernel = rows_kernel_for_sm90(constants, cfg.num_warps, cfg.num_stages,
                                      "*bf16" if cfg.quantize_in_kernel else "*fp8e4nv")
        assert kernel.metadata.shared <= fp8.HOPPER_SHARED_MEMORY, cfg


@sm90_compile.needs_ptxas
def test_rows_kernel_computes_the_norm_for_sm90():
    plain, norm = rows_kernel_ptx_for_sm90(False), rows_kernel_ptx_for_sm90(True)
    assert "rsqrt" in norm and "rsqrt" not in plain  # the RMSNorm's rstd
    assert norm.count("st.global") > plain.count("st.global")  # x + residual for the next layer


@pytest.mark.parametrize("fp8_down", [False, True])
def test_a_down_projection_takes_gated_rows_with_their_amax_parts(fp8_down):
    """An FP8 gate_up kernel hands its rows over with their amax parts; a model-dtype down projection (a checkpoint
    that left it unquantized) and an FP8 one without a tuned choice take the rows as they are."""
    from pdserve.distributed.tensor_parallel import TPGroup
    from pdserve.layers.linear import RowParallelLinear
    from pdserve.quantization.formats import Fp8Scheme

    down = RowParallelLinear(64, 48, False, TPGroup(0, 1), Fp8Scheme(None) if fp8_down else None, amax_part=32)
    # parts are asked for only where the FP8 rows kernel may read them: few rows, dynamic activation scales
    assert [down.reads_amax_parts(rows) for rows in (1, fp8.FUSED_AMAX_ROWS, 3)] == [fp8_down, fp8_down, False]
    if fp8_down:
        down.weight.data, down.weight_scale.data = fp8.quantize_rows(torch.randn(48, 64))
    else:
        torch.nn.init.normal_(down.weight.data)
    x = torch.randn(3, 64)
    assert torch.equal(down(fp8.rows_with_amax(x)), down(x))
