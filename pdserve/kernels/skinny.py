"""Linear layers for few rows (decode batches up to 16): a Triton kernel that streams the weight once with all rows
in one 16-row MMA tile, chosen per (rows, out, in) shape only where it measured faster than cuBLAS on this GPU.

At batch 1 a decode step is the weights read once; cuBLAS reaches the copy ceiling on the large projections but
not on the small ones (H200, 2026-11-23, inside CUDA graphs: llama-3.1-8b qkv 15.9 us, skinny 14.7; o_proj 10.3
vs 8.7; qwen3-0.6b o_proj 12.3 vs 5.1; gate_up stays on cuBLAS, which reads it at the copy ceiling).
`SkinnyTuner.tune` times both on the real weight shapes once, before the CUDA graphs are captured, each call on a
weight read from memory (`cold_weights`: a weight that fits L2 is cycled through copies of it); `linear` then
routes each call by the recorded choice (cuBLAS for any shape not tuned). From 32 rows on cuBLAS's tiles win
(pdserve.bench.skinny_sweep --rows 16 32 64, same day), hence MAX_ROWS. FP8 weights have their own kernel
(`pdserve.quantization.fp8.fp8_rows_linear`, tuned against quantize + `torch._scaled_mm` with the same tuner).
A server start looks each choice up in `pdserve.kernels.tuning_cache` before timing it and stores it after, so a
restart on the same machine skips the timing; where that cache has none, in the table shipped for this GPU (a
shipped choice is run once before it is taken, so a config this Triton cannot build is timed like a miss).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels import tuning_cache
from pdserve.kernels.fp8_rows import Fp8Rows
from pdserve.kernels.parallel_compile import precompile
from pdserve.kernels.pending_rows import PendingNorm, RowsWithAmax

logger = logging.getLogger(__name__)

MAX_ROWS = 16  # the rows of one MMA tile; fewer rows are padded


@dataclass(frozen=True, slots=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# the block shapes that won some shape of pdserve.bench.skinny_sweep on an H200 (2026-11-23)
CANDIDATES = (
    SkinnyConfig(32, 256, 4, 4),
    SkinnyConfig(16, 256, 4, 3),
    SkinnyConfig(64, 128, 4, 4),
    SkinnyConfig(32, 128, 4, 3),
)

# (rows, out, in, weight dtype, `input_kind`, epilogue) -> a config, or None: the baseline measured faster
_choice: dict[tuple[int, int, int, torch.dtype, torch.dtype | str, str | None], object] = {}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the skinny kernel where `SkinnyTuner` chose it for this shape."""
    if x.is_cuda and (cfg := skinny_choice(x, weight)) is not None:
        return skinny_linear(x, weight, bias, cfg)
    return F.linear(x, weight, bias)


def skinny_choice(x: torch.Tensor | Fp8Rows | PendingNorm | RowsWithAmax, weight: torch.Tensor,
                  epilogue: str | None = None) -> SkinnyConfig | None:
    """The config tuned for x's rows times this weight's shape and dtype (and x's `input_kind`, and what the
    kernel computes of the product: its epilogue, None for the product itself); None where the baseline measured
    faster or the shape and row count were not tuned."""
    if len(x.shape) != 2:
        return None
    return _choice.get((x.shape[0], weight.shape[0], weight.shape[1], weight.dtype, input_kind(x), epilogue))


def input_kind(x: torch.Tensor | Fp8Rows | PendingNorm | RowsWithAmax) -> torch.dtype | str:
    """Which kind of rows a choice is tuned for: model-dtype rows (their dtype), FP8 `Fp8Rows` (float8), RMSNorm
    rows still to compute (`PendingNorm`: "rmsnorm"), or rows with their amax in parts (`RowsWithAmax`:
    "amax_parts")."""
    if isinstance(x, PendingNorm):
        return "rmsnorm"
    if isinstance(x, RowsWithAmax):
        return "amax_parts"
    return x.values.dtype if isinstance(x, Fp8Rows) else x.dtype


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: SkinnyConfig
                  ) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] @ weight[N, K]^T (+ bias) in fp32, rounded once to x's dtype; weight rows contiguous."""
    import triton

    from pdserve.kernels.pdl import launch_options
    from pdserve.kernels.skinny_triton import skinny_kernel

    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    skinny_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        ROWS=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_BIAS=bias is not None,
        EVEN_K=k % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x.device),
    )
    return out


def _graph_us(fn, calls: int = 10, reps: int = 7) -> float:
    """Median device microseconds per call of `fn`, captured `calls` times in one CUDA graph: as the decode graphs
    run it, without the host's launch cost (a Triton launch costs more host time than a cuBLAS one)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def cold_weights(w: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A function giving w or one of its copies in turn, so many that each call's weight was evicted from L2 by the
    calls since its last use: a decode step reads every layer's weight once, from memory, and a weight that fits
    L2 (llama-3.1-8b's FP8 qkv and o projections) timed on itself alone would be timed at L2's speed."""
    l2_bytes = torch.cuda.get_device_properties(w.device).L2_cache_size
    w_bytes = w.numel() * w.element_size()
    copies = 1 if w_bytes >= 2 * l2_bytes else 1 + -(-2 * l2_bytes // w_bytes)
    return itertools.cycle([w] + [w.clone() for _ in range(copies - 1)]).__next__


def _tunable(w: torch.Tensor) -> bool:
    """A weight the tuner times: a matrix on a GPU."""
    return w.is_cuda and w.dim() == 2


def _runs(cfg: object, run: Callable[[object], object]) -> bool:
    """Whether a shipped choice runs here: the baseline (None) always; a config where run(cfg) raises nothing (a
    Triton that cannot build it, e.g. for want of shared memory, raises at the launch)."""
    if cfg is None:
        return True
    try:
        run(cfg)
    except Exception as e:
        logger.warning("shipped tuned config %s does not run here (%r); timing the shape instead", cfg, e)
        return False
    return True


def _finite(us: float) -> float | None:
    """A time as JSON takes it (no infinity: a shape with no candidate that runs)."""
    return us if math.isfinite(us) else None


@dataclass(frozen=True, slots=True)
class _Plan:
    """One (weight, rows) a tuner chooses for; cached / shipped: (choice, (baseline us, best us)) from this
    machine's tuning cache / the shipped table, or None."""

    weight: torch.Tensor
    rows: int
    x: object
    entry: str
    cache: tuning_cache.TuningCache | None
    cached: tuple[object, tuple[float, float]] | None
    shipped: tuple[object, tuple[float, float]] | None


class SkinnyTuner:
    """Times a baseline and every candidate config on each weight shape for each row count up to max_rows; records
    the fastest for `skinny_choice` (keyed by the weight's dtype, so bf16 and FP8 weights of one shape are tuned
    apart). candidates: the configs, or a function of the row count giving them; epilogue: what the timed
    functions compute of the product, recorded with the choice (None: the product)."""

    def __init__(self, rows: Iterable[int], label: str = "skinny linear",
                 candidates: tuple | Callable[[int], tuple] = CANDIDATES, max_rows: int = MAX_ROWS,
                 epilogue: str | None = None):
        self.rows = [m for m in rows if m <= max_rows]
        self.label = label
        self.epilogue = epilogue
        self.candidates = candidates if callable(candidates) else lambda rows: candidates

    def tune(self, weights: list[torch.Tensor], x_dtype: torch.dtype | None = None,
             baseline: Callable = F.linear,
             candidate: Callable = lambda x, w, cfg: skinny_linear(x, w, None, cfg),
             prepare: Callable | None = None) -> dict:
        """baseline(x, w) and candidate(x, w, cfg) compute x @ w.T; x is x_dtype (None: the weight's), or what
        prepare makes of it outside the timing (`Fp8Rows`: the choice is then recorded for such rows). The kernels
        the shipped choices and the timings will launch are compiled ahead, in parallel (`parallel_compile`)."""
        start = time.perf_counter()
        shapes = {(w.shape[0], w.shape[1], w.dtype): w for w in weights if _tunable(w)}
        plans = [self._plan(w, m, x_dtype or w.dtype, prepare, tuning_cache.for_device(w.device),
                            tuning_cache.shipped_entries(w.device))  # looked up once a shape (device key: NVML)
                 for w in shapes.values() for m in self.rows]
        if any(plan.weight.is_cuda for plan in plans):
            precompile(lambda: self._launch_once(plans, baseline, candidate))
        report, sources = {}, {"cache": 0, "table": 0}
        weights_cold = {}  # each shape's cold copies, made on its first miss only
        for plan in plans:
            x, w, m = plan.x, plan.weight, plan.rows
            hit, source = self._lookup(plan, lambda cfg: candidate(x, w, cfg))
            if hit is not None:
                choice, times = hit
                sources[source] += 1
            else:
                weight = weights_cold.setdefault(id(w), cold_weights(w))
                reference = _graph_us(lambda: baseline(x, weight()))
                best_us, best = min(self._timings(x, weight, candidate), key=lambda t: t[0],
                                    default=(float("inf"), None))
                choice, times = (best if best_us < reference else None), (reference, best_us)
                if plan.cache is not None:
                    plan.cache.put(plan.entry, {"config": None if choice is None else dataclasses.asdict(choice),
                                                "baseline_us": _finite(reference), "best_us": _finite(best_us)})
            n, k = w.shape
            _choice[(m, n, k, w.dtype, input_kind(x), self.epilogue)] = choice
            report[(m, n, k)] = times
        for cache in {id(p.cache): p.cache for p in plans if p.cache is not None}.values():
            cache.save()
        faster = [key for key, (reference, best) in report.items() if best < reference]
        logger.info("%s tuned %d shapes x rows %s in %.1f s (%d of %d from the tuning cache, %d from the shipped "
                    "table); faster than the baseline on %d of %d: %s", self.label, len(shapes), self.rows,
                    time.perf_counter() - start, sources["cache"], len(report), sources["table"], len(faster),
                    len(report),
                    ", ".join(f"{m}x{n}x{k} {report[(m, n, k)][0]:.1f}->{report[(m, n, k)][1]:.1f} us"
                              for m, n, k in faster))
        return report

    def _plan(self, w: torch.Tensor, m: int, x_dtype: torch.dtype, prepare: Callable | None,
              cache: tuning_cache.TuningCache | None, table: Mapping[str, object]) -> _Plan:
        """One (weight shape, rows) to choose for: its sample rows, its key, and what this machine's tuning cache
        (None: off) and the shipped table hold for it."""
        x = torch.randn(m, w.shape[1], device=w.device, dtype=x_dtype)
        x = prepare(x) if prepare else x
        entry = self._entry(m, w.shape[0], w.shape[1], w.dtype, x_dtype, input_kind(x))
        cached = self._stored(cache.get(entry), m) if cache is not None else None
        shipped = self._stored(table.get(entry), m) if cached is None else None
        return _Plan(w, m, x, entry, cache, cached, shipped)

    def _launch_once(self, plans: list[_Plan], baseline: Callable, candidate: Callable) -> None:
        """What the tuning will launch: each shipped choice's config, and where neither the cache nor the table
        has a choice, the baseline and every candidate."""
        for plan in plans:
            if plan.cached is not None or (plan.shipped is not None and plan.shipped[0] is None):
                continue
            configs = [plan.shipped[0]] if plan.shipped is not None else [None, *self.candidates(plan.rows)]
            for cfg in configs:
                if cfg is None:
                    baseline(plan.x, plan.weight)
                else:
                    candidate(plan.x, plan.weight, cfg)

    def _entry(self, m: int, n: int, k: int, dtype: torch.dtype, x_dtype: torch.dtype,
               kind: torch.dtype | str) -> str:
        """The tuning cache's key of one choice: this tuner, the shape and rows, the weight's and the rows' dtypes,
        the kind of rows, the epilogue, and a digest of the candidates it chooses from."""
        return json.dumps([self.label, self.epilogue, m, n, k, str(dtype), str(x_dtype), str(kind),
                           tuning_cache.digest(tuple(self.candidates(m)))])

    def _lookup(self, plan: _Plan, run: Callable[[object], object]
                ) -> tuple[tuple[object, tuple[float, float]] | None, str]:
        """(the choice, (baseline us, best us)) stored for the plan and where it came from: this machine's tuning
        cache ("cache"), else the shipped table ("table") where its config runs here (run(cfg) launches it once);
        (None, "") where neither has a usable one."""
        if plan.cached is not None:
            return plan.cached, "cache"
        if plan.shipped is not None and _runs(plan.shipped[0], run):
            return plan.shipped, "table"
        return None, ""

    def _stored(self, value: object, m: int) -> tuple[object, tuple[float, float]] | None:
        """(the choice, (baseline us, best us)) a stored value names, or None: nothing stored, or not a known
        candidate for m rows (what comes from disk is checked, never trusted)."""
        if not isinstance(value, dict) or "config" not in value:
            return None
        times = tuple(float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else float("inf")
                      for t in (value.get("baseline_us"), value.get("best_us")))
        if value["config"] is None:
            return None, times
        if not isinstance(value["config"], dict):
            return None
        for cfg in self.candidates(m):
            if dataclasses.is_dataclass(cfg) and dataclasses.asdict(cfg) == value["config"]:
                return cfg, times
        logger.debug("stored tuning value names no candidate config for %d rows: %r", m, value["config"])
        return None

    def _timings(self, x: torch.Tensor | Fp8Rows, weight: Callable[[], torch.Tensor], candidate: Callable
                 ) -> list[tuple[float, object]]:
        timed = []
        for cfg in self.candidates(x.shape[0]):
            try:
                timed.append((_graph_us(lambda c=cfg: candidate(x, weight(), c)), cfg))
            except Exception as e:  # a block shape this GPU cannot hold in shared memory
                logger.debug("skinny config %s does not run here: %r", cfg, e)
        return timed
