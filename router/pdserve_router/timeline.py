"""The router's request timeline: when each request was received, dispatched to each side, got its first byte from
each side and finished, in seconds since it was received.

Every finished request is observed in `pdserve_router_request_stage_seconds{stage}` and, with
`--request-timeline-log PATH`, written as one JSON line in the servers' format (pdserve.timeline, which the router
does not import): {"rid", "role": "router", "arrival_unix", "stages": {name: seconds}}. A stage keeps its first
mark, so a retried request's dispatch is its first attempt's and its first byte the answering attempt's.
"""

from __future__ import annotations

import json
import time
from typing import TextIO

from prometheus_client import Histogram

RECEIVED = "received"
FINISHED = "finished"
# per side; a colocated worker's are the plain `dispatched` and `first_byte`
DISPATCHED = {"prefill": "dispatched_prefill", "decode": "dispatched_decode", "regular": "dispatched"}
FIRST_BYTE = {"prefill": "first_byte_prefill", "decode": "first_byte_decode", "regular": "first_byte"}
ROLE = "router"


class StageClock:
    """One request's stages, on the perf_counter clock from `started` (its arrival)."""

    __slots__ = ("rid", "arrival_unix", "started", "stages")

    def __init__(self, rid: str, started: float):
        self.rid, self.arrival_unix, self.started = rid, time.time(), started
        self.stages: dict[str, float] = {RECEIVED: 0.0}

    def mark(self, stage: str) -> None:
        if stage not in self.stages:
            self.stages[stage] = time.perf_counter() - self.started


class TimelineRecorder:
    """Where finished requests' stages go: the histogram always, the JSON-lines log when a path is given. Used from
    the router's event loop only."""

    def __init__(self, histogram: Histogram, log_path: str | None):
        self.histogram = histogram
        self.log: TextIO | None = open(log_path, "a", buffering=1, encoding="utf-8") if log_path else None

    def finish(self, clock: StageClock) -> None:
        clock.mark(FINISHED)
        for stage, seconds in clock.stages.items():
            self.histogram.labels(stage=stage).observe(seconds)
        if self.log is not None:
            record = {"rid": clock.rid, "role": ROLE, "arrival_unix": clock.arrival_unix, "stages": clock.stages}
            self.log.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None
