"""Where a request's time went: merges the router's and the servers' `--request-timeline-log` lines by rid.

    python -m pdserve.bench.timeline router.jsonl prefill.jsonl decode.jsonl [--json OUT]

Prints, per role, each stage's mean and p50/p90/p99 in ms since the request arrived at that process; then, for the
requests whose lines have every boundary, how the time from the router receiving the request to the first token's
first byte coming back (first_byte_decode, or first_byte for a colocated worker) splits into consecutive segments,
with that time itself as the last row: the segments' means add up to the total's mean exactly (every segment is
taken over the same requests). Each process's stages are placed on the router's clock by the difference of the
lines' `arrival_unix` (the processes share a wall clock: one machine); a segment may come out negative when two
processes' marks are out of order. Requests lacking a role's line, or a boundary stage, are counted and named.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdserve import timeline as tl
from pdserve.bench.stats import PERCENTILES, distribution

ROUTER_ROLE = "router"
CHUNK_END_LAST = tl.PREFILL_CHUNK_END + tl.LAST_SUFFIX


@dataclass(frozen=True, slots=True)
class Boundary:
    role: str
    stages: tuple[str, ...]  # the first of these that the line has


@dataclass(frozen=True, slots=True)
class Breakdown:
    """Consecutive boundaries from the router's `received` to the first token's first byte back at the router;
    `segments[i]` names the time between boundaries i and i + 1."""
    name: str
    boundaries: tuple[Boundary, ...]
    segments: tuple[str, ...]

    @property
    def roles(self) -> frozenset[str]:
        return frozenset(b.role for b in self.boundaries)


def _at(role: str, *stages: str) -> Boundary:
    return Boundary(role, stages)


# a forward's stages are stamped when the device ran it (`pdserve/scheduler/device_stamps.py`)
PREFILL_COMPUTE_END = (CHUNK_END_LAST, tl.PREFILL_CHUNK_END)
TOTAL = "total: router received -> first byte"
PD_BREAKDOWN = Breakdown("pd", (
    _at(ROUTER_ROLE, tl.RECEIVED), _at(tl.PREFILL_ROLE, tl.RECEIVED), _at(tl.PREFILL_ROLE, tl.PREFILL_CHUNK_START),
    _at(tl.PREFILL_ROLE, *PREFILL_COMPUTE_END), _at(tl.PREFILL_ROLE, tl.KV_WRITES_LANDED),
    _at(tl.DECODE_ROLE, tl.KV_LANDED), _at(tl.DECODE_ROLE, tl.FIRST_TOKEN_EMITTED), _at(tl.DECODE_ROLE, tl.SENT),
    _at(ROUTER_ROLE, "first_byte_decode"),
), ("router->prefill dispatch", "prefill tokenize+queue", "prefill forward", "KV writes (after forward)",
    "kv_done to decode", "decode commits first token", "decode detokenize+send", "relay back"))
COLOCATED_BREAKDOWN = Breakdown("colocated", (
    _at(ROUTER_ROLE, tl.RECEIVED), _at(tl.COLOCATED_ROLE, tl.RECEIVED),
    _at(tl.COLOCATED_ROLE, tl.PREFILL_CHUNK_START), _at(tl.COLOCATED_ROLE, *PREFILL_COMPUTE_END),
    _at(tl.COLOCATED_ROLE, tl.SENT), _at(ROUTER_ROLE, "first_byte"),
), ("router->server dispatch", "tokenize+queue", "prefill forward", "sample+detokenize+send", "relay back"))


class TimelineLogError(ValueError):
    """A line that is not a timeline record."""


def read_records(paths: Iterable[str]) -> list[dict]:
    records = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    records.append(_parse(line, f"{path}:{number}"))
    return records


def _parse(line: str, where: str) -> dict:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise TimelineLogError(f"{where}: not JSON: {exc}") from exc
    if not isinstance(record, dict) or not {"rid", "role", "arrival_unix", "stages"} <= record.keys():
        raise TimelineLogError(f"{where}: not a timeline record (rid, role, arrival_unix, stages)")
    return record


def merge_by_rid(records: Iterable[dict]) -> dict[str, dict[str, dict]]:
    """rid -> role -> that role's record (a rid logged twice by one role keeps the later line)."""
    merged: dict[str, dict[str, dict]] = defaultdict(dict)
    for record in records:
        merged[record["rid"]][record["role"]] = record
    return dict(merged)


def stage_percentiles(records: Iterable[dict]) -> dict[str, dict[str, dict]]:
    """role -> stage -> count and mean/p50/p90/p99 in ms since arrival at that role's process."""
    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        for stage, seconds in record["stages"].items():
            samples[record["role"]][stage].append(seconds)
    return {role: {stage: {"count": len(values), **distribution(values)} for stage, values in stages.items()}
            for role, stages in samples.items()}


def segment_times(lines: dict[str, dict], breakdown: Breakdown) -> dict[str, float | None]:
    """One request's segments in seconds (None where a boundary is missing), on the router's clock."""
    points = _boundaries(lines, breakdown)
    return {name: None if start is None or end is None else end - start
            for name, start, end in zip(breakdown.segments, points, points[1:])}


def total_time(lines: dict[str, dict], breakdown: Breakdown) -> float | None:
    """One request's time from the first boundary of `breakdown` to its last (TOTAL), in seconds."""
    points = _boundaries(lines, breakdown)
    return None if points[0] is None or points[-1] is None else points[-1] - points[0]


def _boundaries(lines: dict[str, dict], breakdown: Breakdown) -> list[float | None]:
    origin = lines[ROUTER_ROLE]["arrival_unix"]
    return [_on_router_clock(lines[b.role], b.stages, origin) for b in breakdown.boundaries]


def _on_router_clock(record: dict, stages: Sequence[str], origin: float) -> float | None:
    seconds = next((record["stages"][s] for s in stages if s in record["stages"]), None)
    return None if seconds is None else record["arrival_unix"] - origin + seconds


def breakdown_of(merged: dict[str, dict[str, dict]], breakdown: Breakdown) -> dict:
    """The segments' distributions, and the total's (TOTAL), over the requests whose lines have every boundary of
    `breakdown`; the others are counted by the roles they lack, or as lacking a boundary stage."""
    with_roles = [lines for lines in merged.values() if breakdown.roles <= lines.keys()]
    points = [p for p in (_boundaries(lines, breakdown) for lines in with_roles) if None not in p]
    segments = {name: _distribution([p[i + 1] - p[i] for p in points]) for i, name in enumerate(breakdown.segments)}
    segments[TOTAL] = _distribution([p[-1] - p[0] for p in points])
    lacking: dict[str, int] = defaultdict(int)
    for lines in merged.values():
        if lines.keys() & breakdown.roles and not breakdown.roles <= lines.keys():
            lacking[",".join(sorted(breakdown.roles - lines.keys()))] += 1
    return {"requests": len(points), "segments": segments, "lacking": dict(lacking),
            "lacking_a_stage": len(with_roles) - len(points)}


def _distribution(values: list[float]) -> dict:
    return {"count": len(values), **distribution(values)}


def analyze(records: list[dict]) -> dict:
    """Per-role stage percentiles, and the breakdown of each kind (PD, colocated) whose servers logged."""
    merged = merge_by_rid(records)
    server_roles = {record["role"] for record in records} - {ROUTER_ROLE}
    kinds = [b for b in (PD_BREAKDOWN, COLOCATED_BREAKDOWN) if server_roles & b.roles]
    return {"stages": stage_percentiles(records), "breakdown": {b.name: breakdown_of(merged, b) for b in kinds}}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_report(report: dict) -> str:
    lines = []
    for role, stages in sorted(report["stages"].items()):
        lines += [f"[{role}]", _header("stage")]
        rows = sorted(stages.items(), key=lambda item: item[1]["p50"])
        lines += [_row(stage, dist) for stage, dist in rows] + [""]
    for name, result in report["breakdown"].items():
        lines.append(f"client send -> first token ({name}, {result['requests']} requests with every role's line)")
        lines.append(_header("segment"))
        lines += [_row(segment, dist) for segment, dist in result["segments"].items()]
        lines += [f"note: {count} request(s) lack a {roles} line; left out of this breakdown"
                  for roles, count in result["lacking"].items()]
        if result["lacking_a_stage"]:
            lines.append(f"note: {result['lacking_a_stage']} request(s) lack a boundary stage (a failed or aborted "
                         "request); left out of this breakdown")
        lines.append("")
    if not report["breakdown"] or ROUTER_ROLE not in report["stages"]:
        lines.append("note: no breakdown without both the router's and the servers' lines "
                     "(give every process's --request-timeline-log)")
    return "\n".join(lines).rstrip() + "\n"


def _header(what: str) -> str:
    return f"{what:38s} {'count':>7s} {'mean ms':>10s}" + "".join(f" {f'p{p} ms':>10s}" for p in PERCENTILES)


def _row(name: str, dist: dict) -> str:
    return f"{name:38s} {dist['count']:7d} {_ms(dist['mean']):>10s}" + "".join(
        f" {_ms(dist[f'p{p}']):>10s}" for p in PERCENTILES)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.timeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", metavar="LOG", help="--request-timeline-log files (router and servers).")
    parser.add_argument("--json", metavar="OUT", help="Also write the report as JSON here.")
    ns = parser.parse_args(argv)
    try:
        report = analyze(read_records(ns.logs))
    except (OSError, TimelineLogError) as exc:
        print(f"pdserve.bench.timeline: {exc}", file=sys.stderr)
        return 1
    print(format_report(report), end="")
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
