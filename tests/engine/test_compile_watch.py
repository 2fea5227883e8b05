"""Compiles after ready: once armed, every Triton compile (a real one, for a CUDA target, which Triton runs on the CPU
too) is counted and named in a warning with its time, a load from the on-disk cache as well, and a listener
installed before is still called."""

from __future__ import annotations

import logging

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pdserve.engine import compile_watch  # noqa: E402


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(dst + offsets, tl.load(src + offsets, mask=offsets < n), mask=offsets < n)


def test_armed_watch_counts_and_names_each_triton_compile(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_watch, "_watch", None)
    earlier: list[bool] = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kw: earlier.append(kw["cache_hit"]))
    source = ASTSource(_copy_kernel, {"src": "*fp32", "dst": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                       {"BLOCK": 64})
    triton.compile(source, target=GPUTarget("cuda", 80, 32))  # before ready: not counted
    assert compile_watch.compiles_after_ready() == 0
    watch = compile_watch.arm()
    assert compile_watch.arm() is watch
    with caplog.at_level(logging.WARNING, logger=compile_watch.__name__):
        triton.compile(ASTSource(_copy_kernel, source.signature, {"BLOCK": 128}), target=GPUTarget("cuda", 80, 32))
        triton.compile(source, target=GPUTarget("cuda", 80, 32))
    assert compile_watch.compiles_after_ready() == 2 and earlier == [False, False, True]
    compiled, loaded = (record.getMessage() for record in caplog.records)
    assert compiled.startswith("after ready, compiled triton kernel _copy_kernel(BLOCK=128) in ")
    assert loaded.startswith("after ready, loaded from the on-disk cache triton kernel _copy_kernel(BLOCK=64) in ")
    assert compiled.endswith(" ms (warm-up did not reach it)")



def test_a_role_switch_warm_up_compiles_uncounted(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_watch, "_watch", None)
    monkeypatch.setattr(knobs.compilation, "listener", None)
    source = ASTSource(_copy_kernel, {"src": "*fp32", "dst": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                       {"BLOCK": 32})
    compile_watch.arm()
    with caplog.at_level(logging.WARNING, logger=compile_watch.__name__), compile_watch.warming_up():
        triton.compile(source, target=GPUTarget("cuda", 80, 32))
    assert compile_watch.compiles_after_ready() == 0 and caplog.records == []
    triton.compile(ASTSource(_copy_kernel, source.signature, {"BLOCK": 256}), target=GPUTarget("cuda", 80, 32))
    assert compile_watch.compiles_after_ready() == 1  # counted again once the warm-up is over
