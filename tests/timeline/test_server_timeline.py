"""The servers' request timelines through real processes on the CPU (the tiny model): a colocated server logs every
stage of a request, in order; a prefill and a decode server behind a router log their roles' stages, which
`python -m pdserve.bench.timeline` merges with the router's line by rid; /metrics exports the stage histogram with
the server's role."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_util import decode_server, free_port, prefill_server, router, server, start_all, stop_all

from pdserve import timeline as tl

CHUNK_FLAGS = ["--chunked-prefill-size", "32"]  # the prompt below takes several chunks
PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches from the garden wall. " * 5
SAMPLING = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
CHUNK_END_LAST = tl.PREFILL_CHUNK_END + tl.LAST_SUFFIX
# in the order a request passes them
COLOCATED_STAGES = (tl.RECEIVED, tl.TOKENIZED, tl.QUEUED, tl.ADMITTED, tl.PREFILL_CHUNK_START, tl.PREFILL_CHUNK_END,
                    CHUNK_END_LAST, tl.FIRST_TOKEN_SAMPLED, tl.FIRST_TOKEN_EMITTED, tl.DETOKENIZED, tl.SENT,
                    tl.FINISHED)
PREFILL_STAGES = (tl.RECEIVED, tl.TOKENIZED, tl.BOOTSTRAP_RESOLVED, tl.DECODE_PAGES_KNOWN, tl.QUEUED, tl.ADMITTED,
                  tl.PREFILL_CHUNK_START, tl.KV_WRITES_ISSUED, CHUNK_END_LAST, tl.FIRST_TOKEN_SAMPLED,
                  tl.KV_WRITES_LANDED, tl.HANDOFF_RELEASED, tl.FINISHED)
DECODE_STAGES = (tl.RECEIVED, tl.TOKENIZED, tl.PAGES_PREALLOCATED, tl.TRANSFER_REQUEST_SENT, tl.KV_LANDED,
                 tl.OUTPUT_TOKEN, tl.FIRST_TOKEN_EMITTED, tl.DETOKENIZED, tl.SENT, tl.FINISHED)


FLAG = "--request-timeline-log"


@pytest.fixture(scope="module")
def colocated(tiny_model, tmp_path_factory) -> Iterator[tuple]:
    """A colocated server with its timeline log."""
    log = tmp_path_factory.mktemp("timeline") / "regular.jsonl"
    proc = server("colocated", tiny_model, *CHUNK_FLAGS, FLAG, str(log))
    start_all([proc])
    yield proc, log
    stop_all([proc])


@pytest.fixture(scope="module")
def pd_logged(tiny_model, tmp_path_factory) -> Iterator[dict]:
    """A prefill + decode pair behind a router, each with its own timeline log."""
    logs = {name: tmp_path_factory.mktemp("timeline") / f"{name}.jsonl" for name in ("prefill", "decode", "router")}
    bootstrap = free_port()
    procs = {"prefill": prefill_server(tiny_model, "tcp", bootstrap, *CHUNK_FLAGS, FLAG, str(logs["prefill"])),
             "decode": decode_server(tiny_model, "tcp", FLAG, str(logs["decode"]))}
    start_all(list(procs.values()))
    procs["router"] = router([(procs["prefill"], bootstrap)], [procs["decode"]], FLAG, str(logs["router"]))
    try:
        start_all([procs["router"]])
        yield {"procs": procs, "logs": logs}
    finally:
        stop_all(list(procs.values()))


def timeline_line(path: Path, rid: str, timeout: float = 10.0) -> dict:
    """The log's line of `rid` (written as the answer goes out: it may trail the client's read by a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        found = [line for line in lines if line["rid"] == rid]
        if found or time.monotonic() > deadline:
            assert len(found) == 1, f"{rid} in {path}: {lines}"
            return found[0]
        time.sleep(0.05)


def assert_stages_in_order(record: dict, expected: tuple[str, ...]) -> None:
    stages = record["stages"]
    assert set(expected) <= stages.keys(), f"missing {set(expected) - stages.keys()} in {stages}"
    times = [stages[name] for name in expected]
    assert times == sorted(times), dict(zip(expected, times))
    assert stages[tl.RECEIVED] == 0.0 and abs(record["arrival_unix"] - time.time()) < 600


def stage_count(proc, role: str, stage: str) -> float:
    text = proc.get("/metrics").body.decode()
    match = re.search(rf'^pdserve_request_stage_seconds_count{{role="{role}",stage="{stage}"}} (\S+)$', text, re.M)
    assert match, f"no {role}/{stage} sample at {proc.name}'s /metrics"
    return float(match.group(1))


@pytest.mark.parametrize("stream", [False, True])
def test_a_colocated_request_passes_every_stage_in_order(colocated, stream):
    proc, log = colocated
    rid = f"colocated-{stream}"
    prompt = f"{rid}: {PROMPT}"  # its own: a prefix-cache hit would leave a single chunk to prefill
    reply = proc.post("/generate", {"text": prompt, "rid": rid, "sampling_params": SAMPLING, "stream": stream})
    assert reply.status == 200, reply.body
    record = timeline_line(log, rid)
    assert record["role"] == tl.COLOCATED_ROLE
    assert_stages_in_order(record, COLOCATED_STAGES)
    assert record["stages"][tl.OUTPUT_TOKEN] < record["stages"][tl.OUTPUT_TOKEN + tl.LAST_SUFFIX]  # 4 tokens
    assert stage_count(proc, tl.COLOCATED_ROLE, tl.SENT) >= 1


def test_a_pd_request_is_logged_by_both_roles_and_merged_with_the_router(pd_logged):
    procs, logs = pd_logged["procs"], pd_logged["logs"]
    reply = procs["router"].post("/generate", {"text": PROMPT, "sampling_params": SAMPLING, "stream": True},
                                 headers={"X-Request-Id": "pd-1"})
    assert reply.status == 200, reply.body
    assert_stages_in_order(timeline_line(logs["prefill"], "pd-1"), PREFILL_STAGES)
    assert_stages_in_order(timeline_line(logs["decode"], "pd-1"), DECODE_STAGES)
    timeline_line(logs["router"], "pd-1")
    merged = subprocess.run([sys.executable, "-m", "pdserve.bench.timeline", *map(str, logs.values())],
                            capture_output=True, text=True, check=True).stdout
    breakdown = merged.split("client send -> first token (pd, ")[1]
    assert breakdown.startswith("1 requests with every role's line)"), merged
    for segment in ("prefill queue", "prefill compute", "KV transfer", "relay back"):
        assert re.search(rf"^{segment} +1 ", breakdown, re.M), merged
    assert stage_count(procs["prefill"], tl.PREFILL_ROLE, tl.KV_WRITES_LANDED) == 1
    assert stage_count(procs["decode"], tl.DECODE_ROLE, tl.KV_LANDED) == 1
