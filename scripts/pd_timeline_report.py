"""Issue 36's timeline targets from one PD run (scripts/pd_timeline.sh): the router's, prefill's and decode's
--request-timeline-log lines of the run at 8 req/s, its client-side results (pdserve.bench.serving JSON), and the
4 req/s runs of PD and of colocated x2. Prints each target with its figures and PASS or MISS; --json writes them.

    python scripts/pd_timeline_report.py --timelines router.jsonl prefill.jsonl decode.jsonl --serving pd8.json \
        --pd pd4.json --colocated colocated4.json [--json report.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from pdserve import timeline as tl
from pdserve.bench.stats import distribution
from pdserve.bench.timeline import PD_BREAKDOWN, ROUTER_ROLE, TOTAL, analyze, merge_by_rid, read_records

ELIGIBLE_P99_MS = 5.0  # prefill received -> queued
WRITES_OVER_FORWARD_MS = 5.0  # kv_writes_issued -> kv_writes_landed, p50, over the forward's GPU time
SEGMENTS_VS_CLIENT = 0.02  # the timeline's total against the client's TTFT
PD_OVER_COLOCATED_MS = 15.0  # TTFT p50 at 4 req/s
FORWARD_END = (tl.PREFILL_CHUNK_END + tl.LAST_SUFFIX, tl.PREFILL_CHUNK_END)


def between(record: dict, start: str, ends: tuple[str, ...]) -> float | None:
    """Seconds from `start` to the first of `ends` that the record has (None: a stage is missing)."""
    stages = record["stages"]
    end = next((stages[s] for s in ends if s in stages), None)
    return None if start not in stages or end is None else end - stages[start]


def per_request(records: list[dict], role: str, measure: Callable[[dict], float | None]) -> list[float]:
    return [v for v in (measure(r) for r in records if r["role"] == role) if v is not None]


def on_router_clock(lines: dict[str, dict], role: str, stage: str) -> float | None:
    record = lines.get(role)
    if record is None or ROUTER_ROLE not in lines or stage not in record["stages"]:
        return None
    return record["arrival_unix"] - lines[ROUTER_ROLE]["arrival_unix"] + record["stages"][stage]


def eligibility(records: list[dict]) -> dict:
    dist = distribution(per_request(records, tl.PREFILL_ROLE, lambda r: between(r, tl.RECEIVED, (tl.QUEUED,))))
    return {"target": f"prefill received -> queued p99 <= {ELIGIBLE_P99_MS:g} ms", "ms": dist,
            "pass": dist["p99"] is not None and dist["p99"] <= ELIGIBLE_P99_MS}


def writes_against_forward(records: list[dict]) -> dict:
    writes = distribution(per_request(records, tl.PREFILL_ROLE,
                                      lambda r: between(r, tl.KV_WRITES_ISSUED, (tl.KV_WRITES_LANDED,))))
    forward = distribution(per_request(records, tl.PREFILL_ROLE,
                                       lambda r: between(r, tl.PREFILL_CHUNK_START, FORWARD_END)))
    ok = None not in (writes["p50"], forward["p50"]) and writes["p50"] <= forward["p50"] + WRITES_OVER_FORWARD_MS
    return {"target": f"kv_writes_issued -> kv_writes_landed p50 <= forward GPU time p50 + {WRITES_OVER_FORWARD_MS:g} ms",
            "writes_ms": writes, "forward_ms": forward, "pass": ok}


def segments_against_client(records: list[dict], serving: dict) -> dict:
    total = analyze(records)["breakdown"].get(PD_BREAKDOWN.name, {}).get("segments", {}).get(TOTAL)
    client = serving["runs"][0]["ttft_ms"]
    gaps = {stat: None if total is None or total[stat] is None or not client[stat]
            else abs(total[stat] - client[stat]) / client[stat] for stat in ("mean", "p50")}
    return {"target": f"timeline segments sum to the client's TTFT within {SEGMENTS_VS_CLIENT:.0%} (mean, p50)",
            "timeline_ms": total, "client_ms": client, "relative_gap": gaps,
            "pass": all(g is not None and g <= SEGMENTS_VS_CLIENT for g in gaps.values())}


def landed_order(records: list[dict]) -> dict:
    """Per request on the router's clock: the decode's kv_landed after the prefill's kv_writes_landed."""
    pairs = [(on_router_clock(lines, tl.PREFILL_ROLE, tl.KV_WRITES_LANDED),
              on_router_clock(lines, tl.DECODE_ROLE, tl.KV_LANDED)) for lines in merge_by_rid(records).values()]
    gaps = [decode - prefill for prefill, decode in pairs if prefill is not None and decode is not None]
    before = sum(g < 0 for g in gaps)
    return {"target": "decode kv_landed after prefill kv_writes_landed, every request",
            "requests": len(gaps), "decode_first": before, "decode_minus_prefill_ms": distribution(gaps),
            "pass": bool(gaps) and before == 0}


def pd_against_colocated(pd: dict, colocated: dict) -> dict:
    pd_p50, colocated_p50 = pd["runs"][0]["ttft_ms"]["p50"], colocated["runs"][0]["ttft_ms"]["p50"]
    return {"target": f"TTFT p50 at 4 req/s: PD <= colocated x2 + {PD_OVER_COLOCATED_MS:g} ms",
            "pd_ms": pd_p50, "colocated_ms": colocated_p50,
            "pass": None not in (pd_p50, colocated_p50) and pd_p50 <= colocated_p50 + PD_OVER_COLOCATED_MS}


def report(records: list[dict], serving: dict, pd: dict | None, colocated: dict | None) -> list[dict]:
    checks = [eligibility(records), writes_against_forward(records), segments_against_client(records, serving),
              landed_order(records)]
    if pd is not None and colocated is not None:
        checks.append(pd_against_colocated(pd, colocated))
    return checks


def _figures(check: dict) -> str:
    def ms(dist: dict) -> str:
        return "/".join("-" if dist.get(k) is None else f"{dist[k]:.1f}" for k in ("p50", "p90", "p99"))

    parts = []
    for key, value in check.items():
        if key in ("target", "pass"):
            continue
        if isinstance(value, dict) and "p90" in value:
            parts.append(f"{key} p50/p90/p99 {ms(value)}")
        elif isinstance(value, dict):
            parts.append(f"{key} " + ", ".join(f"{k} {'-' if v is None else f'{v:.1%}'}" for k, v in value.items()))
        else:
            parts.append(f"{key} {'-' if value is None else (f'{value:.1f}' if isinstance(value, float) else value)}")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timelines", nargs="+", required=True, help="router, prefill and decode timeline logs")
    parser.add_argument("--serving", required=True, help="pdserve.bench.serving JSON of the same run")
    parser.add_argument("--pd", help="pdserve.bench.serving JSON of PD at 4 req/s")
    parser.add_argument("--colocated", help="pdserve.bench.serving JSON of colocated x2 at 4 req/s")
    parser.add_argument("--json", help="write the checks here")
    ns = parser.parse_args(argv)

    def load(path: str | None) -> dict | None:
        if path is None:
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    checks = report(read_records(ns.timelines), load(ns.serving), load(ns.pd), load(ns.colocated))
    for check in checks:
        print(f"{'PASS' if check['pass'] else 'MISS'}  {check['target']}\n      {_figures(check)}")
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as f:
            json.dump(checks, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
