"""KV-transfer counters of one PD role, kept by its scheduler thread and read by the server's /metrics.

Torch-free. `snapshot()` is a msgpack-ready dict (the scheduler's stats carry it to the HTTP process), with the
duration histogram's cumulative bucket counts so the metrics module only renders it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# every failure reason of each role, exported from the start at 0 so that a rate() sees the first failure
FAILURE_REASONS = {
    "prefill": ("aborted", "peer_refused", "peer_aborted", "write_failed", "bootstrap_timeout"),
    "decode": ("aborted", "handshake_failed", "handshake_timeout", "transfer_timeout", "bad_first_token",
               "peer_failed", "peer_dead"),
}


@dataclass(slots=True)
class TransferStats:
    """Bytes moved, handoffs completed with their transfer time, and failures by reason. The prefill also sums the
    time its engine writes took, against the link's bandwidth (`link_gbps`, 0 if unknown) for its efficiency."""

    role: str
    link_gbps: float = 0.0
    bytes: int = 0
    write_seconds: float = 0.0
    transfers: int = 0
    duration_sum: float = 0.0
    duration_counts: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS) + 1))
    failures: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.failures = dict.fromkeys(FAILURE_REASONS[self.role], 0)

    def moved(self, nbytes: int, write_seconds: float = 0.0) -> None:
        """`nbytes` reached the peer; the prefill says how long its engine took to write them."""
        self.bytes += nbytes
        self.write_seconds += write_seconds

    def link_efficiency(self) -> float | None:
        """The share of the link the writes reached: bytes over write time, over `link_gbps` (None: unknown)."""
        if not self.link_gbps or not self.write_seconds:
            return None
        return self.bytes / self.write_seconds / (self.link_gbps * 1e9)

    def completed(self, seconds: float) -> None:
        """One handoff's KV arrived in `seconds` of transfer time."""
        self.transfers += 1
        self.duration_sum += seconds
        self.duration_counts[bisect.bisect_left(DURATION_BUCKETS, seconds)] += 1

    def failed(self, reason: str) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1  # a reason missing from FAILURE_REASONS still counts

    def snapshot(self, queues: dict[str, int]) -> dict:
        cumulative, total = [], 0
        for count in self.duration_counts:
            total += count
            cumulative.append(total)
        return {"role": self.role, "bytes": self.bytes, "transfers": self.transfers,
                "write_seconds": self.write_seconds, "link_efficiency": self.link_efficiency(),
                "duration_buckets": [[le, n] for le, n in zip((*DURATION_BUCKETS, float("inf")), cumulative)],
                "duration_sum": self.duration_sum, "failures": dict(self.failures), "queues": queues}
