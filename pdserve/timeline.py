"""Request timelines: when each request passes each stage in one server process (no torch, no engine imports).

A `RequestTimeline` starts when the request arrives (`RequestTimeline.begin`, which marks RECEIVED at 0) and keeps,
per stage name, the seconds since arrival on the monotonic clock. A stage is kept at its first mark; a repeated
stage (REPEATED_STAGES: a prefill chunk's start and end, an output token) also keeps its latest mark under
`name#last` once it has been marked twice, so a record stays small however many chunks or tokens a request has.
The HTTP process owns a request's timeline; its scheduler marks its own stages in the request's `StageMarks` and
sends them along in the request's next output message (`RequestTimeline.merge` takes them in).

`TimelineSink.finish` ends a timeline: it observes every stage in the histogram
`pdserve_request_stage_seconds{role,stage}` and, with a log path (`--request-timeline-log PATH`), appends one JSON
object per line: {"rid", "role", "arrival_unix", "stages": {name: seconds since arrival}}. The router writes the
same format with role "router"; `python -m pdserve.bench.timeline` merges the lines of all roles by rid.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple, TextIO

from prometheus_client import CollectorRegistry, Histogram

# roles: a server's disaggregation mode, "regular" for a colocated one (the router's name for it too)
PREFILL_ROLE, DECODE_ROLE, COLOCATED_ROLE = "prefill", "decode", "regular"



def server_role(disaggregation_mode: str) -> str:
    """The role of a server started with `--disaggregation-mode` (null: colocated)."""
    return COLOCATED_ROLE if disaggregation_mode == "null" else disaggregation_mode


# every role
RECEIVED = "received"
DETOKENIZED = "detokenized"
SENT = "sent"  # first mark: the answer's first bytes written to the client (a stream's first chunk)
FINISHED = "finished"
# a server (prefill, decode or colocated)
TOKENIZED = "tokenized"
QUEUED = "queued"
ADMITTED = "admitted"
PREFILL_CHUNK_START = "prefill_chunk_start"
PREFILL_CHUNK_END = "prefill_chunk_end"
FIRST_TOKEN_SAMPLED = "first_token_sampled"
# a prefill server's side of the KV handoff
BOOTSTRAP_RESOLVED = "bootstrap_resolved"
DECODE_PAGES_KNOWN = "decode_pages_known"
KV_WRITES_ISSUED = "kv_writes_issued"
KV_WRITES_LANDED = "kv_writes_landed"
HANDOFF_RELEASED = "handoff_released"
# a decode server's side
PAGES_PREALLOCATED = "pages_preallocated"
TRANSFER_REQUEST_SENT = "transfer_request_sent"
KV_LANDED = "kv_landed"
FIRST_TOKEN_EMITTED = "first_token_emitted"
OUTPUT_TOKEN = "output_token"

REPEATED_STAGES = frozenset({PREFILL_CHUNK_START, PREFILL_CHUNK_END, OUTPUT_TOKEN})
LAST_SUFFIX = "#last"
STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                 10.0, 30.0, 60.0, 120.0)


class Arrival(NamedTuple):
    """When a request arrived, on the wall clock and on the monotonic clock."""
    unix: float
    monotonic: float

    @classmethod
    def now(cls) -> Arrival:
        return cls(time.time(), time.monotonic())


@dataclass(slots=True)
class RequestTimeline:
    rid: str
    role: str
    arrival_unix: float
    arrival_monotonic: float
    stages: dict[str, float] = field(default_factory=dict)

    @classmethod
    def begin(cls, rid: str, role: str, arrival: Arrival | None = None) -> RequestTimeline:
        """A timeline for a request arriving at `arrival` (default: now), with RECEIVED marked at 0."""
        timeline = cls(rid, role, *(arrival or Arrival.now()))
        timeline.stages[RECEIVED] = 0.0
        return timeline

    def mark(self, stage: str, now: float | None = None) -> None:
        """Records `stage` at `now` (time.monotonic(); default: now): its first mark, and for a repeated stage its
        latest one as well."""
        seconds = (time.monotonic() if now is None else now) - self.arrival_monotonic
        if stage not in self.stages:
            self.stages[stage] = seconds
        elif stage in REPEATED_STAGES:
            self.stages[stage + LAST_SUFFIX] = seconds

    def merge(self, marks: dict[str, float]) -> None:
        """Records another process's `StageMarks.take()`: time.monotonic() values, comparable with ours because
        every process of a server runs on one host (CLOCK_MONOTONIC is system-wide)."""
        for stage, at in marks.items():
            self.mark(stage.removesuffix(LAST_SUFFIX), at)

    def record(self) -> dict:
        """The JSON object of one finished request."""
        return {"rid": self.rid, "role": self.role, "arrival_unix": self.arrival_unix, "stages": dict(self.stages)}


class StageMarks:
    """A scheduler's marks of one request, on the monotonic clock, kept until `take` hands them to the request's next
    output message: a stage's first mark, and a repeated stage's latest under `name#last` (one entry, overwritten),
    so nothing grows per token."""

    __slots__ = ("marked", "unsent")

    def __init__(self) -> None:
        self.marked: set[str] = set()
        self.unsent: dict[str, float] = {}

    def mark(self, stage: str, now: float | None = None) -> None:
        if stage not in self.marked:
            self.marked.add(stage)
            key = stage
        elif stage in REPEATED_STAGES:
            key = stage + LAST_SUFFIX
        else:
            return
        self.unsent[key] = time.monotonic() if now is None else now

    def take(self) -> dict[str, float] | None:
        """The marks made since the previous take, or None when there are none."""
        if not self.unsent:
            return None
        marks, self.unsent = self.unsent, {}
        return marks


class TimelineSink:
    """Where finished timelines go: the stage histogram always, the JSON-lines log when a path is given.
    `finish` may be called from any thread."""

    def __init__(self, registry: CollectorRegistry, log_path: str | None = None):
        self.histogram = Histogram("pdserve_request_stage_seconds", "Seconds from a request's arrival at this "
                                   "process to each stage it passed, by role and stage.", ("role", "stage"),
                                   buckets=STAGE_BUCKETS, registry=registry)
        self.lock = threading.Lock()
        self.log: TextIO | None = open(log_path, "a", buffering=1, encoding="utf-8") if log_path else None

    def finish(self, timeline: RequestTimeline) -> None:
        """Marks FINISHED (unless already marked) and records the request."""
        timeline.mark(FINISHED)
        for stage, seconds in timeline.stages.items():
            self.histogram.labels(role=timeline.role, stage=stage).observe(seconds)
        if self.log is not None:
            line = json.dumps(timeline.record(), separators=(",", ":")) + "\n"
            with self.lock:
                if self.log is not None:
                    self.log.write(line)

    def close(self) -> None:
        with self.lock:
            if self.log is not None:
                self.log.close()
                self.log = None
