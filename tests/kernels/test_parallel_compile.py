"""Triton compiles ahead, in worker processes (pdserve.kernels.parallel_compile): a kernel specialization compiled in
a spawned worker for sm_90 lands in Triton's cache under the key the parent's own compile of it looks up (the
parent's compile then writes nothing: a cache hit); failures are counted, not raised; the worker count's setting.
On a GPU: launches under `collect_compiles` record their compiles and launch nothing, and after the workers compiled
them the real launches build nothing in-process (neither the kernels nor their launchers)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from sm90_compile import needs_ptxas

from pdserve.kernels import parallel_compile

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402


@triton.jit
def scale_kernel(X, Y, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n) * factor, mask=offs < n)


def sm90_job(block: int) -> parallel_compile.CompileJob:
    """What the JIT's cache hook records for a launch of scale_kernel on an sm_90 GPU (fp32 pointers aligned to 16,
    n and factor not specialized), in Triton's own serialization."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import serialize_specialization_data

    options = make_backend(GPUTarget("cuda", 90, 32)).parse_options({"num_warps": 4, "num_stages": 2})
    signature = {"X": "*fp32", "Y": "*fp32", "n": "i32", "factor": "fp32", "BLOCK": "constexpr"}
    data = serialize_specialization_data("scale_kernel", signature, {(4,): block},
                                         {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]},
                                         options, "key")
    return parallel_compile.CompileJob(scale_kernel.fn.__module__, "scale_kernel", data, ("cuda", 90, 32))


def parent_compile(job: parallel_compile.CompileJob):
    """The parent's compile of the job's specialization, as the JIT makes it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend

    data = json.loads(job.specialization)
    target = GPUTarget(*job.target)
    options = make_backend(target).parse_options({"num_warps": 4, "num_stages": 2})  # as sm90_job's launch
    source = ASTSource(scale_kernel, data["signature"], {(4,): data["constant_vals"][0]},
                       {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]})
    return triton.compile(source, target=target, options=options.__dict__)


def cache_files(directory) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


@needs_ptxas
def test_a_worker_compiles_into_the_cache_the_parent_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    jobs = [sm90_job(256), sm90_job(512)]
    assert not any(parallel_compile.is_cached(job) for job in jobs)
    assert parallel_compile.compile_in_workers(jobs, workers=2) == 2
    assert all(parallel_compile.is_cached(job) for job in jobs)  # what a warm start leaves out
    compiled = cache_files(tmp_path / "triton")
    assert sum(name.endswith(".cubin") for name in compiled) == 2
    kernel = parent_compile(jobs[0])  # the JIT's compile of the same specialization: found, nothing written
    assert cache_files(tmp_path / "triton") == compiled
    assert "ld.global" in kernel.asm["ptx"] and kernel.metadata.num_warps == 4


@needs_ptxas
def test_a_failing_compile_is_counted_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    missing = parallel_compile.CompileJob("no_such_module_here", "scale_kernel", sm90_job(256).specialization,
                                          ("cuda", 90, 32))
    assert parallel_compile.compile_in_workers([missing, sm90_job(256)], workers=2) == 1


def test_the_worker_count_setting(monkeypatch):
    monkeypatch.setenv("PDSERVE_COMPILE_WORKERS", "0")
    assert parallel_compile.num_workers() == 0
    assert parallel_compile.precompile(lambda: pytest.fail("called with no workers")) == 0
    monkeypatch.setenv("PDSERVE_COMPILE_WORKERS", "3")
    assert parallel_compile.num_workers() == 3
    monkeypatch.delenv("PDSERVE_COMPILE_WORKERS")
    assert 0 <= parallel_compile.num_workers() <= parallel_compile.MAX_WORKERS


@pytest.mark.gpu
def test_launches_compiled_ahead_compile_nothing_in_process(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    y = torch.zeros_like(x)

    def launch_all():
        for block in (128, 256, 512):
            scale_kernel[(triton.cdiv(1000, block),)](x, y, 1000, 2.0, BLOCK=block)

    jobs = parallel_compile.collect_compiles(launch_all)
    assert len(jobs) == 3 and not y.any()  # recorded, nothing launched
    assert parallel_compile.compile_in_workers(jobs, workers=3) == 3
    compiled = cache_files(tmp_path / "triton")
    launch_all()
    assert cache_files(tmp_path / "triton") == compiled  # every launch found its kernel in the cache
    torch.testing.assert_close(y, 2 * x)


@needs_ptxas
def test_shared_workers_serve_every_compile_inside_and_stop_on_leaving(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("PDSERVE_COMPILE_WORKERS", "2")
    with parallel_compile.shared_workers():
        assert parallel_compile.compile_in_workers([sm90_job(256)], workers=2) == 1
        pool = parallel_compile._shared["pool"]
        assert parallel_compile.compile_in_workers([sm90_job(512), sm90_job(1024)], workers=2) == 2
        assert parallel_compile._shared["pool"] is pool  # one pool for both
        processes = list(pool._processes.values())
    assert not parallel_compile._shared and all(not p.is_alive() for p in processes)
    assert sum(name.endswith(".cubin") for name in cache_files(tmp_path / "triton")) == 3


def test_a_worker_that_dies_breaks_nothing_but_its_compiles(tmp_path, monkeypatch):
    """A worker killed mid-compile breaks its pool: precompile reports 0 without raising, the shared pool is dropped,
    and the next precompile in the same `shared_workers` starts a fresh one."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("PDSERVE_COMPILE_WORKERS", "2")
    jobs = [sm90_job(256)] * parallel_compile.MIN_JOBS
    monkeypatch.setattr(parallel_compile, "collect_compiles", lambda launch_all: list(jobs))
    monkeypatch.setattr(parallel_compile, "is_cached", lambda job: False)
    monkeypatch.setattr(parallel_compile, "compile_job", _exit_worker)
    with parallel_compile.shared_workers():
        assert parallel_compile.precompile(lambda: None) == 0
        assert "pool" not in parallel_compile._shared
        monkeypatch.setattr(parallel_compile, "compile_job", _no_op)
        assert parallel_compile.precompile(lambda: None) == parallel_compile.MIN_JOBS
    assert not parallel_compile._shared


def _exit_worker(job) -> None:
    os._exit(3)


def _no_op(job) -> None:
    return None
