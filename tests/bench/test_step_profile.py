"""The step profiler's reading of a Chrome trace: per-kernel time per step, categories, busy fraction and gaps."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.step_profile import category, summarize


def kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "ph": "X"}


@pytest.mark.parametrize("name, expected", [
    ("_decode_split_kernel", "attention"),
    ("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", "gemm"),
    ("cublasLt::splitKreduce_kernel<32, 16>", "gemm"),
    ("skinny_kernel", "gemm"),
    ("_rmsnorm_kernel", "norm"),
    ("_store_kv_kernel", "kv_store"),
    ("_rotary_kernel", "rotary"),
    ("_silu_and_mul_kernel", "activation"),
    ("at::native::reduce_kernel<512, 1, ArgMaxOps>", "sampling"),
    ("Memcpy DtoD ", "copy"),
    ("at::native::elementwise_kernel<128, 4>", "elementwise/other"),
])
def test_kernel_categories(name, expected):
    assert category(name) == expected


def test_summary_counts_time_per_step_and_gaps(tmp_path):
    events = [
        kernel("void _rmsnorm_kernel(float*)", 0, 2), kernel("nvjet_sm90_gemm", 2, 10),
        kernel("_decode_split_kernel", 15, 5),  # a 3 us gap before it
        kernel("void _rmsnorm_kernel(float*)", 20, 2), kernel("Memcpy DtoH", 30, 1, cat="gpu_memcpy"),  # 8 us gap
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50, "ph": "X"},  # host events are not GPU time
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    p = summarize(path, "two steps", steps=2, wall_s=62e-6)
    assert p.kernel_us_per_step == pytest.approx(10.0)  # 20 us of GPU work over 2 steps
    assert p.wall_us_per_step == pytest.approx(31.0)
    assert p.gpu_busy == pytest.approx(20 / 62)
    assert p.gaps_us_per_step == pytest.approx((3 + 8) / 2)
    assert p.gaps_over_5us_per_step == pytest.approx(0.5)
    assert p.launches_per_step == pytest.approx(2.5)
    top = p.kernels[0]
    assert (top.name, top.category, top.us_per_step, top.launches_per_step) == ("nvjet_sm90_gemm", "gemm", 5.0, 0.5)
    norm = next(r for r in p.kernels if r.category == "norm")
    assert norm.name == "_rmsnorm_kernel" and norm.launches_per_step == 1.0 and norm.us_per_step == 2.0
    assert list(p.categories) == ["gemm", "attention", "norm", "copy"]  # largest first
    assert sum(r.share for r in p.kernels) == pytest.approx(1.0)
