"""The step timer. On the CPU, with a clock the test sets: an extend is timed from its own start, a decode step from
the end of the step before it (the time between two tokens, host work between the steps included), or from its own
start after a step without a forward; each timed step is reported once, in order. On a GPU: by the device's work,
which the host's launch returns long before."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.scheduler.step_timer import DECODE, EXTEND, StepTimer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def step(timer: StepTimer, clock: Clock, kind: str, size: int, gap: float, forward: float, booked=None) -> None:
    """A step whose forward starts `gap` seconds after the previous step's end and takes `forward` seconds."""
    clock.now += gap
    timer.begin(kind)
    clock.now += forward
    timer.end(kind, size, booked)


def test_extends_from_their_start_decode_steps_from_the_step_before():
    clock = Clock()
    timer = StepTimer(torch.device("cpu"), clock)
    step(timer, clock, EXTEND, 256, gap=1.0, forward=0.5, booked=0.4)
    step(timer, clock, DECODE, 2, gap=0.1, forward=0.2, booked=0.3)
    step(timer, clock, DECODE, 2, gap=0.1, forward=0.2)
    timings = timer.completed()
    assert [(t.kind, t.size, t.booked_s) for t in timings] == [(EXTEND, 256, 0.4), (DECODE, 2, 0.3), (DECODE, 2, None)]
    assert [t.seconds for t in timings] == pytest.approx([0.5, 0.1 + 0.2, 0.1 + 0.2])
    assert timer.completed() == []


def test_a_decode_step_after_an_idle_step_is_timed_from_its_own_start():
    clock = Clock()
    timer = StepTimer(torch.device("cpu"), clock)
    step(timer, clock, DECODE, 1, gap=0.0, forward=0.2)
    clock.now += 5.0
    timer.idle()
    step(timer, clock, DECODE, 1, gap=0.1, forward=0.2)
    assert [t.seconds for t in timer.completed()] == pytest.approx([0.2, 0.2])


@pytest.mark.gpu
def test_on_a_gpu_an_extend_is_timed_by_its_device_work_not_by_its_launch():
    timer = StepTimer(torch.device("cuda"))
    a = torch.randn(8192, 8192, device="cuda")
    a @ a  # cuBLAS's first call sets up its handle and workspace: that launch is slow, the ones timed below are not
    torch.cuda.synchronize()
    started = time.perf_counter()
    timer.begin(EXTEND)
    for _ in range(20):
        a = a @ a / 100
    timer.end(EXTEND, 8192, None)
    launched = time.perf_counter() - started
    torch.cuda.synchronize()
    ran = time.perf_counter() - started
    [timing] = timer.completed()
    assert timing.seconds > 5 * launched and timing.seconds == pytest.approx(ran, rel=0.2)
