"""`DeviceStamps`: a stage marked when the device reached a point of its stream, read without a sync."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.scheduler.device_stamps import DeviceStamps
from pdserve.timeline import PREFILL_CHUNK_END, StageMarks


def test_on_the_cpu_a_stage_is_marked_when_the_call_returns():
    stamps, marks = DeviceStamps(torch.device("cpu")), [StageMarks(), StageMarks()]
    before = time.monotonic()
    stamps.mark_when_reached(marks, PREFILL_CHUNK_END)
    after = time.monotonic()
    for m in marks:
        assert before <= m.take()[PREFILL_CHUNK_END] <= after
    stamps.close()


@pytest.mark.gpu
def test_on_a_gpu_the_stage_is_when_the_kernels_ran_not_when_they_were_launched():
    """A kernel that spins ~200 ms: the mark returns at once, `settle` before the device is done marks nothing, and
    once it is done the stamp lies between the kernel's end and the host's sync on it."""
    stamps, marks = DeviceStamps(torch.device("cuda")), StageMarks()
    torch.cuda.synchronize()
    cycles_per_ms = torch.cuda.get_device_properties(0).clock_rate  # kHz: cycles per ms
    launched = time.monotonic()
    torch.cuda._sleep(200 * cycles_per_ms)
    stamps.mark_when_reached([marks], PREFILL_CHUNK_END)
    assert time.monotonic() - launched < 0.05  # no sync on the way
    stamps.settle()
    assert marks.take() is None  # the device is still sleeping
    torch.cuda.synchronize()
    synced = time.monotonic()
    stamps.settle()
    stamped = marks.take()[PREFILL_CHUNK_END]
    # the helper thread wakes on the event's completion a scheduling delay after the host's own sync may return
    assert launched + 0.1 < stamped <= synced + 0.005
    stamps.close()
