"""Kernels compiled after the server reported ready: counted, and each one named in a warning with its time.

Everything real traffic needs should be compiled by the warm-up; one that is not costs its first requests the
compile. `arm()`, called once in the scheduler process when it announces ready, installs a Triton compilation
listener (`triton.knobs.compilation.listener`, which Triton calls at the end of every `compile()`: a new
specialization built, or loaded from the on-disk cache; launches of a kernel already in memory do not call it)
and chains any listener installed before. `compiles_after_ready()` is the count for
`pdserve_compiles_after_ready_total`. pdserve uses no torch.compile, and cuBLAS/cuDNN heuristics expose no hook.
A role switch warms its new role up after ready (`warming_up()`): those compiles are expected and not counted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger(__name__)


class CompileWatch:
    """The compiles seen since it was armed; `record` may be called from any thread."""

    def __init__(self, chained: Any = None):
        self.chained = chained  # the Triton listener installed before this one, called after it
        self.count = 0
        self.lock = threading.Lock()
        self.warming_up = False

    def record(self, what: str, seconds: float, from_disk_cache: bool) -> None:
        if self.warming_up:
            return
        with self.lock:
            self.count += 1
        source = "loaded from the on-disk cache" if from_disk_cache else "compiled"
        logger.warning("after ready, %s %s in %.1f ms (warm-up did not reach it)", source, what, seconds * 1e3)

    def triton_listener(self, *, src: Any, metadata: dict, metadata_group: dict, times: Any, cache_hit: bool) -> None:
        """Triton's CompilationListener: `times` is a CompileTimes (microseconds)."""
        self.record(describe_triton_source(src), times.total / 1e6, cache_hit)
        if self.chained is not None:
            self.chained(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)


def describe_triton_source(src: Any) -> str:
    """`kernel(CONSTEXPR=value, ...)` for a JIT function's source; the name alone for IR sources."""
    fn = getattr(src, "fn", None)
    if fn is None:
        return str(getattr(src, "name", src))
    constants = ", ".join(f"{fn.arg_names[path[0]]}={value}" for path, value in sorted(src.constants.items())
                          if len(path) == 1)
    return f"triton kernel {src.name}({constants})"


_watch: CompileWatch | None = None


def arm() -> CompileWatch:
    """From now on, counts and logs every Triton compile (once armed, a second call returns the same watch)."""
    global _watch
    if _watch is None:
        from triton import knobs

        _watch = CompileWatch(knobs.compilation.listener)
        knobs.compilation.listener = _watch.triton_listener
    return _watch


@contextmanager
def warming_up() -> Iterator[None]:
    """Compiles inside (a role switch's warm-up of its new role) are expected: neither counted nor logged."""
    if _watch is None:
        yield
        return
    _watch.warming_up = True
    try:
        yield
    finally:
        _watch.warming_up = False


def compiles_after_ready() -> int:
    return 0 if _watch is None else _watch.count
