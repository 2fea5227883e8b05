"""Stage marks at the moment the device reached a point of its stream, read without stalling the scheduler.

A forward pass on a GPU returns to the scheduler once its kernels are queued; a stage marked then says when the
work was launched, not when it ran. `DeviceStamps.mark_when_reached` records a CUDA event at the current point of
the stream instead; a helper thread waits on the events in order (a blocking-sync event: it sleeps, it does not
spin a core) and notes when each completed. The scheduler thread applies those times to the requests' marks in
`settle`, at a point where it reads the device anyway, so that a mark made this way goes out in the same output
message as it would have when stamped on the spot. On the CPU every mark is made at once: the work has run when
the call returns.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from pdserve.timeline import StageMarks

STAMP_WAIT_S = 1.0  # the longest `settle` waits for the helper to note an event that has completed


@dataclass(slots=True, eq=False)
class _Pending:
    event: torch.cuda.Event
    marks: list[StageMarks]
    stage: str
    reached: threading.Event = field(default_factory=threading.Event)
    at: float = 0.0  # time.monotonic() when the helper saw the event complete


class DeviceStamps:
    def __init__(self, device: torch.device):
        self.on_cuda = device.type == "cuda"
        self.pending: deque[_Pending] = deque()  # scheduler thread only, in stream order
        self.jobs: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        if self.on_cuda:
            self.thread = threading.Thread(target=self._wait_in_order, name="device-stamps", daemon=True)
            self.thread.start()

    def mark_when_reached(self, marks: list[StageMarks], stage: str) -> None:
        """Marks `stage` in each of `marks` when the device reaches this point of the current stream."""
        if not self.on_cuda:
            now = time.monotonic()
            for m in marks:
                m.mark(stage, now)
            return
        event = torch.cuda.Event(blocking=True)
        event.record()
        entry = _Pending(event, marks, stage)
        self.pending.append(entry)
        self.jobs.put(entry)

    def settle(self) -> None:
        """Applies, in stream order, the marks of every event the device has completed (never waits for the
        device; at most STAMP_WAIT_S for the helper to note one that completed)."""
        while self.pending and self.pending[0].event.query():
            entry = self.pending.popleft()
            at = entry.at if entry.reached.wait(STAMP_WAIT_S) else time.monotonic()
            for m in entry.marks:
                m.mark(entry.stage, at)

    def _wait_in_order(self) -> None:
        while (entry := self.jobs.get()) is not None:
            entry.event.synchronize()
            entry.at = time.monotonic()
            entry.reached.set()

    def close(self) -> None:
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join(timeout=5)
