"""The router's request timeline through a real router process in front of stub servers: every stage of a PD and
of a colocated request present and in order, the stage histogram at /metrics, one JSON line per request in the
servers' format."""

from __future__ import annotations

import json
import time
from pathlib import Path

from pdserve_router.timeline import DISPATCHED, FIRST_BYTE

PD_STAGES = ("received", "dispatched_decode", "dispatched_prefill", "first_byte_prefill", "first_byte_decode",
             "finished")


def timeline_lines(path: Path, count: int, timeout: float = 5.0) -> list[dict]:
    """The log's lines once it has `count` (the router writes a line after the client has its answer)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count or time.monotonic() > deadline:
            return [json.loads(line) for line in lines]
        time.sleep(0.02)


def assert_in_order(stages: dict[str, float], *names: str) -> None:
    assert [stages[name] for name in names] == sorted(stages[name] for name in names), stages


def test_pd_request_stages_are_logged_in_order_and_exported(stubs, start_router, tmp_path):
    prefill, decode = stubs.add("prefill"), stubs.add("decode", token_interval_s=0.02)
    log = tmp_path / "router.jsonl"
    router = start_router("--prefill", prefill.url, "--decode", decode.url, "--request-timeline-log", str(log))
    reply = router.post("/generate", {"text": "hi", "stream": True}, headers={"X-Request-Id": "tl-1"})
    assert reply.status == 200
    reply = router.post("/generate", {"text": "hi", "rid": "client-rid", "stream": True})
    assert reply.status == 200
    first, second = timeline_lines(log, 2)
    assert (first["rid"], first["role"], second["rid"]) == ("tl-1", "router", "client-rid")
    assert abs(first["arrival_unix"] - time.time()) < 60
    for record in (first, second):
        stages = record["stages"]
        assert set(stages) == set(PD_STAGES) and stages["received"] == 0.0
        assert_in_order(stages, "received", "dispatched_decode", "dispatched_prefill", "first_byte_prefill",
                        "finished")
        assert_in_order(stages, "dispatched_decode", "first_byte_decode", "finished")
    assert router.metric('pdserve_router_request_stage_seconds_count{stage="first_byte_decode"}') == 2
    assert router.metric('pdserve_router_request_stage_seconds_bucket{le="120.0",stage="finished"}') == 2


def test_colocated_request_has_one_worker_stages(stubs, start_router, tmp_path):
    worker = stubs.add("regular")
    log = tmp_path / "router.jsonl"
    router = start_router("--worker", worker.url, "--request-timeline-log", str(log))
    assert router.post("/v1/completions", {"prompt": "hi", "stream": True}).status == 200
    (record,) = timeline_lines(log, 1)
    assert list(record["stages"]) == ["received", DISPATCHED["regular"], FIRST_BYTE["regular"], "finished"]
    assert_in_order(record["stages"], *record["stages"])


def test_without_a_log_the_histogram_still_counts(stubs, start_router):
    worker = stubs.add("regular")
    router = start_router("--worker", worker.url)
    assert router.post("/generate", {"text": "hi"}).status == 200
    deadline = time.monotonic() + 5
    while router.metric('pdserve_router_request_stage_seconds_count{stage="finished"}') != 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert router.metric('pdserve_router_request_stage_seconds_count{stage="first_byte"}') == 1
