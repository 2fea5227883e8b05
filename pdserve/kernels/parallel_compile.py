"""Triton compiles of many kernels at once, in worker processes, ahead of the launches that need them.

Triton compiles a kernel on its first launch, one at a time, and holds the GIL for most of it (threads gain little:
four decode kernels compiled for sm_90 on two cores took 9.8 s one after another and 8.3 s in four threads). A server
start on an empty cache launches a hundred or more kernels for the first time: the tuners' (each shipped choice is
launched once) and the decode graphs' (a step at each captured batch size). `precompile(launch_all)` calls launch_all
with Triton's JIT cache hook recording every launch that would compile (Triton's own `specialization_data` of it) and
launching nothing, then compiles what it recorded in spawned worker processes into Triton's on-disk cache
(TRITON_CACHE_DIR, which they inherit), each kernel with its launcher (the C stub Triton builds for a kernel's
arguments); the real launches after it find both there. The workers need no GPU: they compile for the target the
parent's GPU names.

Workers: env PDSERVE_COMPILE_WORKERS (0 turns this off: every launch compiles in-process, as before), else up to
8, one fewer than the CPUs. Within `shared_workers()` (the model runner's tuning and graph capture) every precompile
uses one pool, spawned on entering (its workers import while the caller prepares) and stopped on leaving;
elsewhere each precompile starts and stops its own. A worker's failure or timeout only costs the time it saved: the
launch then compiles in-process, and reports what that compile reports.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAX_WORKERS = 8
MIN_JOBS = 3  # fewer compile in-process: a first job waits for the workers' imports (5 s on an H200 host)
COMPILE_TIMEOUT_S = 600.0  # for all of one precompile's jobs together

_shared: dict[str, object] = {}  # within shared_workers: "workers" (the count), "pool" once started


@dataclass(frozen=True, slots=True)
class CompileJob:
    """One kernel specialization: the module and name of its @triton.jit function, Triton's JSON of the
    specialization (signature, constexprs, attributes, options), and the target as (backend, arch, warp size)."""

    module: str
    name: str
    specialization: str
    target: tuple[str, int | str, int]


def num_workers() -> int:
    value = os.environ.get("PDSERVE_COMPILE_WORKERS", "").strip()
    if value:
        return max(0, int(value))
    return min(MAX_WORKERS, max(0, (os.cpu_count() or 1) - 1))


@contextmanager
def shared_workers() -> Iterator[None]:
    """Within: the precompiles share one pool of workers (spawned once: each worker imports Triton and the kernels'
    modules once), shut down on leaving."""
    _shared["workers"] = num_workers()
    if _shared["workers"] > 0:  # spawned now, importing while the caller prepares its first launches
        pool = ProcessPoolExecutor(_shared["workers"], mp_context=multiprocessing.get_context("spawn"))
        _shared["pool"] = pool
        for _ in range(_shared["workers"]):
            pool.submit(warm_worker)
    try:
        yield
    finally:
        pool = _shared.get("pool")
        _shared.clear()
        if pool is not None:
            try:
                pool.shutdown(wait=True, cancel_futures=True)
            except Exception as e:  # a broken pool shuts down as far as it can
                logger.debug("the compile workers' pool ended with %r", e)


def precompile(launch_all: Callable[[], object]) -> int:
    """Calls launch_all() with every Triton launch that would compile recorded instead of run (nothing is launched
    then, so launch_all must not read what its launches would write), and compiles the recorded kernels in worker
    processes into Triton's cache; returns how many it compiled. For a caller about to make the same launches for
    real. With no workers it calls nothing and returns 0; fewer than MIN_JOBS compiles it leaves to the launches."""
    workers = _shared.get("workers", num_workers())
    if workers <= 0:
        return 0
    jobs = [job for job in collect_compiles(launch_all) if not _is_cached_or_unknown(job)]  # a warm start: none
    if len(jobs) < MIN_JOBS:
        return 0
    start = time.perf_counter()
    try:
        done = compile_in_workers(jobs, workers)
    except Exception as e:  # a broken pool (a worker killed): the launches compile in-process
        logger.warning("compiling ahead failed (%r); the kernels compile at their launches", e)
        _drop_shared_pool()
        return 0
    logger.info("compiled %d of %d Triton kernels in %d worker processes in %.1f s", done, len(jobs),
                min(workers, len(jobs)), time.perf_counter() - start)
    return done


def _is_cached_or_unknown(job: CompileJob) -> bool:
    """is_cached, True where the lookup itself fails (a kernel this process cannot name: its launch compiles it)."""
    try:
        return is_cached(job)
    except Exception as e:
        logger.debug("no cache lookup for %s.%s: %r", job.module, job.name, e)
        return True


def _drop_shared_pool() -> None:
    pool = _shared.pop("pool", None)
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)


def collect_compiles(launch_all: Callable[[], object]) -> list[CompileJob]:
    """The kernel specializations launch_all's Triton launches would compile (each once), none of them launched."""
    from triton import knobs
    from triton.runtime.driver import driver

    if knobs.runtime.jit_cache_hook is not None:  # someone else's hook: leave the launches alone
        return []
    target = driver.active.get_current_target()
    jobs: dict[tuple[str, str, str], CompileJob] = {}

    def record(*, fn, compile, **_) -> bool:
        job = CompileJob(fn.module, fn.name, compile["specialization_data"],
                         (target.backend, target.arch, target.warp_size))
        jobs.setdefault((job.module, job.name, str(compile["key"])), job)
        return True  # skip the compile, and so the launch

    knobs.runtime.jit_cache_hook = record
    try:
        launch_all()
    except Exception as e:  # what was recorded until then still saves its compiles
        logger.warning("collecting the kernels to compile ahead stopped early: %r", e)
    finally:
        knobs.runtime.jit_cache_hook = None
    return list(jobs.values())


def compile_in_workers(jobs: list[CompileJob], workers: int) -> int:
    """Compiles the jobs in spawned processes (the shared pool within `shared_workers`) into Triton's cache;
    returns how many compiled. Waits at most COMPILE_TIMEOUT_S for all of them."""
    shared = "workers" in _shared
    pool = _shared.get("pool") if shared else None
    if pool is None:
        pool = ProcessPoolExecutor(workers if shared else min(workers, len(jobs)),
                                   mp_context=multiprocessing.get_context("spawn"))
        if shared:
            _shared["pool"] = pool
    futures = [pool.submit(compile_job, job) for job in jobs]
    finished, unfinished = wait(futures, timeout=COMPILE_TIMEOUT_S)
    if unfinished:
        logger.warning("%d kernel compiles did not finish in %.0f s; their launches compile in-process",
                       len(unfinished), COMPILE_TIMEOUT_S)
        for process in list((pool._processes or {}).values()):  # no public way to stop a running worker
            process.terminate()
        _shared.pop("pool", None)
    if unfinished or not shared:
        pool.shutdown(wait=not unfinished, cancel_futures=True)
    failed = [f.exception() for f in finished if f.exception() is not None]
    if shared and any(isinstance(error, BrokenProcessPool) for error in failed):  # a worker died: a fresh pool next
        _drop_shared_pool()
    for error in failed[:3]:
        logger.debug("a kernel compile ahead failed (its launch compiles in-process): %r", error)
    return len(finished) - len(failed)


def warm_worker() -> None:
    """In a worker: the imports every compile needs, done before the first."""
    import triton.compiler.compiler  # noqa: F401

    import pdserve.kernels  # noqa: F401  (torch and the kernels' package)


def compile_job(job: CompileJob) -> None:
    """In a worker: the kernel job names compiled for its target, as Triton's JIT would compile it (same source,
    specialization and options, so the same cache key), into Triton's cache."""
    import triton

    source, target, options = _prepared(job)
    compiled = triton.compile(source, target=target, options=options)
    if target.backend == "cuda":
        build_cuda_launcher(compiled)


def is_cached(job: CompileJob) -> bool:
    """Whether Triton's on-disk cache holds the job's kernel already (its first launch only loads it): the lookup
    `triton.compile` makes."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_key, get_cache_manager

    source, target, options = _prepared(job)
    backend = make_backend(target)
    parsed = backend.parse_options(dict(options, **source.parse_options()))
    key = get_cache_key(source, backend, parsed, get_cache_invalidating_env_vars())
    name = f"{source.name[:150]}.json"
    group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(name)
    return group is not None and name in group


def _prepared(job: CompileJob):
    """(the ASTSource, the GPUTarget, the options dict) of the job, as the JIT hands them to `triton.compile`."""
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend

    kernel = getattr(importlib.import_module(job.module), job.name)
    data = json.loads(job.specialization)
    constexprs = {tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v) else
                  tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v
                  for k, v in zip(data["constant_keys"], data["constant_vals"])}
    attrs = dict(zip(map(tuple, data["attrs_keys"]), data["attrs_vals"]))
    signature = {k: tuple(v) if isinstance(v, list) else v for k, v in data["signature"].items()}
    target = GPUTarget(*job.target)
    options = make_backend(target).parse_options(
        {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()})
    return ASTSource(kernel, signature, constexprs, attrs), target, options.__dict__


def build_cuda_launcher(compiled) -> None:
    """The host stub that launches `compiled` (a small C module Triton builds with the system's compiler, cached
    beside the kernels), built here so the parent's first launch finds it; where this machine cannot link it (no
    CUDA driver library) the parent's first launch builds it."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(compiled.src, compiled.metadata)
    except Exception as e:
        logger.debug("no CUDA launcher built ahead: %r", e)
