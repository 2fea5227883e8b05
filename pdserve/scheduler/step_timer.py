"""How long the scheduler's forward steps take, for the TPOT budget and the prefill rate (`tpot_budget.py`, `load.py`).

A forward on a GPU is asynchronous: the host returns from a non-final prefill chunk, or from an overlapped decode
launch, before the GPU has computed it. So on a GPU each step is timed by CUDA events recorded around it on the
device's stream, and read once its end event has completed: an extend from its start to its end (idle gaps while
the host launched its kernels included); a decode step from the end of the step before it (step to step: the time
between two tokens of a running request, host work between the steps included), or from its own start after a
step without a forward. On the CPU a forward is synchronous and the same marks are clock readings.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

EXTEND = "extend"
DECODE = "decode"


@dataclass(frozen=True, slots=True)
class StepTiming:
    kind: str  # EXTEND or DECODE
    size: int  # an extend's prompt tokens, a decode step's requests
    seconds: float
    booked_s: float | None  # what the TPOT budget booked at launch (None: nothing)


@dataclass(slots=True)
class _Pending:
    kind: str
    size: int
    booked_s: float | None
    start: float | torch.cuda.Event
    end: float | torch.cuda.Event


class StepTimer:
    """`clock`: seconds, monotonic (tests give one their fake forwards advance)."""

    __slots__ = ("on_gpu", "clock", "pending", "began", "last_end")

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter):
        self.on_gpu = device.type == "cuda"
        self.clock = clock
        self.pending: deque[_Pending] = deque()
        self.began: float | torch.cuda.Event | None = None
        self.last_end: float | torch.cuda.Event | None = None  # the previous step's end, unless it had no forward

    def begin(self, kind: str) -> None:
        """A step of `kind` starts (a decode step that follows another step is timed from that one's end)."""
        self.began = self._mark() if kind == EXTEND or self.last_end is None else None

    def end(self, kind: str, size: int, booked_s: float | None) -> None:
        end = self._mark()
        start = self.last_end if kind == DECODE and self.last_end is not None else self.began
        self.pending.append(_Pending(kind, size, booked_s, start, end))
        self.last_end = end

    def idle(self) -> None:
        """A step without a forward: the next decode step is timed from its own start."""
        self.last_end = None

    def completed(self) -> list[StepTiming]:
        """The timed steps whose device work has finished, oldest first (each reported once)."""
        done = []
        while self.pending and (not self.on_gpu or self.pending[0].end.query()):
            p = self.pending.popleft()
            done.append(StepTiming(p.kind, p.size, self._seconds(p.start, p.end), p.booked_s))
        return done

    def _mark(self) -> float | torch.cuda.Event:
        if not self.on_gpu:
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, start, end) -> float:
        if self.on_gpu:
            return start.elapsed_time(end) / 1e3
        return end - start
