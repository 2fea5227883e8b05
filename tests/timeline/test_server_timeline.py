"""The servers' request timelines through real processes on the CPU (the tiny model): a colocated server logs every
stage of a request, in order; a prefill and a decode server behind a router log their roles' stages, which
`python -m pdserve.bench.timeline` merges with the router's line by rid (an OpenAI request's too, by the router's
request id); the prefill's KV writes land before the decode learns of them; the breakdown's segments add up to the
client's time to first token; /metrics exports the stage histogram with the server's role."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_util import CHILD_ENV, decode_server, free_port, prefill_server, router, server, start_all, stop_all

from pdserve import timeline as tl
from pdserve.bench import timeline as bt
from pdserve.scheduler.process import STEP_DELAY_ENV

CHUNK_FLAGS = ["--chunked-prefill-size", "32"]  # the prompt below takes several chunks
PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches from the garden wall. " * 5
SAMPLING = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
CHUNK_END_LAST = tl.PREFILL_CHUNK_END + tl.LAST_SUFFIX
# in the order a request passes them
COLOCATED_STAGES = (tl.RECEIVED, tl.TOKENIZED, tl.QUEUED, tl.ADMITTED, tl.PREFILL_CHUNK_START, tl.PREFILL_CHUNK_END,
                    CHUNK_END_LAST, tl.FIRST_TOKEN_SAMPLED, tl.FIRST_TOKEN_EMITTED, tl.DETOKENIZED, tl.SENT,
                    tl.FINISHED)
# a prefill request is queued without waiting for its decode's page list; its KV writes wait for the list
PREFILL_STAGES = (tl.RECEIVED, tl.TOKENIZED, tl.QUEUED, tl.ADMITTED, tl.PREFILL_CHUNK_START, CHUNK_END_LAST,
                  tl.FIRST_TOKEN_SAMPLED, tl.KV_WRITES_LANDED, tl.HANDOFF_RELEASED, tl.FINISHED)
PREFILL_HANDOFF_STAGES = (tl.TOKENIZED, tl.BOOTSTRAP_RESOLVED, tl.DECODE_PAGES_KNOWN, tl.KV_WRITES_ISSUED,
                          tl.KV_WRITES_LANDED)
DECODE_STAGES = (tl.RECEIVED, tl.TOKENIZED, tl.PAGES_PREALLOCATED, tl.TRANSFER_REQUEST_SENT, tl.KV_LANDED,
                 tl.OUTPUT_TOKEN, tl.FIRST_TOKEN_EMITTED, tl.DETOKENIZED, tl.SENT, tl.FINISHED)


FLAG = "--request-timeline-log"
PREFILL_STEP_S = 0.1


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
    """A prefill + decode pair behind a router, each with its own timeline log. The prefill pauses PREFILL_STEP_S
    before each step, so that a time to first token is long next to the client's own HTTP round trip."""
    logs = {name: tmp_path_factory.mktemp("timeline") / f"{name}.jsonl" for name in ("prefill", "decode", "router")}
    bootstrap = free_port()
    procs = {"prefill": prefill_server(tiny_model, "tcp", bootstrap, *CHUNK_FLAGS, FLAG, str(logs["prefill"])),
             "decode": decode_server(tiny_model, "tcp", FLAG, str(logs["decode"]))}
    procs["prefill"].env = {**CHILD_ENV, STEP_DELAY_ENV: str(PREFILL_STEP_S)}
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


def test_an_openai_request_takes_its_request_id_header_as_its_rid(colocated, tiny_model):
    """A direct client's X-Request-Id names the timeline line, the answer's id carries OpenAI's prefix before it;
    an overlong one is refused."""
    proc, log = colocated
    body = {"model": tiny_model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    reply = proc.post("/v1/completions", body, headers={"X-Request-Id": "direct-1"})
    assert reply.status == 200, reply.body
    assert reply.json()["id"] == "cmpl-direct-1"
    assert timeline_line(log, "direct-1")["role"] == tl.COLOCATED_ROLE
    reply = proc.post("/v1/completions", body, headers={"X-Request-Id": "x" * 513})
    assert reply.status == 400 and "X-Request-Id" in reply.json()["error"]["message"]


def test_a_pd_request_is_logged_by_both_roles_and_merged_with_the_router(pd_logged):
    procs, logs = pd_logged["procs"], pd_logged["logs"]
    reply = procs["router"].post("/generate", {"text": PROMPT, "sampling_params": SAMPLING, "stream": True},
                                 headers={"X-Request-Id": "pd-1"})
    assert reply.status == 200, reply.body
    prefill_line = timeline_line(logs["prefill"], "pd-1")
    assert_stages_in_order(prefill_line, PREFILL_STAGES)
    assert_stages_in_order(prefill_line, PREFILL_HANDOFF_STAGES)
    assert_stages_in_order(timeline_line(logs["decode"], "pd-1"), DECODE_STAGES)
    timeline_line(logs["router"], "pd-1")
    merged = subprocess.run([sys.executable, "-m", "pdserve.bench.timeline", *map(str, logs.values())],
                            capture_output=True, text=True, check=True).stdout
    breakdown = merged.split("client send -> first token (pd, ")[1]
    assert breakdown.startswith("1 requests with every role's line)"), merged
    for segment in ("prefill tokenize+queue", "prefill forward", "KV writes (after forward)", "kv_done to decode",
                    "relay back", bt.TOTAL):
        assert re.search(rf"^{re.escape(segment)} +1 ", breakdown, re.M), merged
    assert stage_count(procs["prefill"], tl.PREFILL_ROLE, tl.KV_WRITES_LANDED) == 1
    assert stage_count(procs["decode"], tl.DECODE_ROLE, tl.KV_LANDED) == 1


def on_one_clock(record: dict, stage: str) -> float:
    return record["arrival_unix"] + record["stages"][stage]


def lines_of(logs: dict[str, Path], rid: str) -> dict[str, dict]:
    return {role: timeline_line(logs[name], rid) for name, role in
            (("router", bt.ROUTER_ROLE), ("prefill", tl.PREFILL_ROLE), ("decode", tl.DECODE_ROLE))}


def test_the_prefills_writes_land_before_the_decode_learns_of_them(pd_logged):
    """The prefill's `kv_writes_landed` is when its last write landed (its writer's time), so it precedes the
    decode's `kv_landed` (the decode read `kv_done`, sent once the writes landed)."""
    procs, logs = pd_logged["procs"], pd_logged["logs"]
    reply = procs["router"].post("/generate", {"text": f"landed: {PROMPT}", "sampling_params": SAMPLING},
                                 headers={"X-Request-Id": "pd-landed"})
    assert reply.status == 200, reply.body
    prefill, decode = timeline_line(logs["prefill"], "pd-landed"), timeline_line(logs["decode"], "pd-landed")
    assert on_one_clock(prefill, CHUNK_END_LAST) <= on_one_clock(prefill, tl.KV_WRITES_LANDED) \
        <= on_one_clock(decode, tl.KV_LANDED)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_openai_request_is_logged_by_every_process_under_the_routers_request_id(pd_logged, tiny_model, path):
    """No id from the client: the router's request id is the rid of all three lines, and the answer's id is
    OpenAI's prefix before it."""
    procs, logs = pd_logged["procs"], pd_logged["logs"]
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    reply = procs["router"].post(path, {**body, "model": tiny_model, "max_tokens": 3, "temperature": 0})
    assert reply.status == 200, reply.body
    prefix = "cmpl-" if path == "/v1/completions" else "chatcmpl-"
    answer_id = reply.json()["id"]
    assert answer_id.startswith(prefix)
    rid = answer_id.removeprefix(prefix)
    assert rid == reply.headers["X-Request-Id"]
    lines = lines_of(logs, rid)
    assert bt.segment_times(lines, bt.PD_BREAKDOWN)["kv_done to decode"] >= 0


def first_token_seconds(proc, body: dict, rid: str) -> float:
    """The client's time to first token: from opening the connection to the first streamed event."""
    host, port = proc.url.removeprefix("http://").split(":")
    started = time.perf_counter()
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json", "X-Request-Id": rid})
        response = conn.getresponse()
        assert response.status == 200
        while not response.readline().startswith(b"data: "):
            pass
        first = time.perf_counter() - started
        response.read()
        return first
    finally:
        conn.close()


def test_the_breakdowns_segments_add_up_to_the_clients_time_to_first_token(pd_logged):
    """Per request, the segments add up to the router's time to first byte exactly, which lies within the
    client's time to first token and, the prefill being slowed to PREFILL_STEP_S a step, within 2% of it (or 50 ms:
    the client's connect and the relay's first byte wait for a core on a loaded machine)."""
    procs, logs = pd_logged["procs"], pd_logged["logs"]
    for i in range(3):
        rid = f"ttft-{i}"
        body = {"text": f"{rid}: {PROMPT}", "sampling_params": SAMPLING, "stream": True}
        client_s = first_token_seconds(procs["router"], body, rid)
        lines = lines_of(logs, rid)
        segments = bt.segment_times(lines, bt.PD_BREAKDOWN)
        total = bt.total_time(lines, bt.PD_BREAKDOWN)
        assert all(v >= 0 for v in segments.values()), segments
        assert sum(segments.values()) == pytest.approx(total, rel=1e-9)
        assert total <= client_s and client_s - total <= max(0.02 * client_s, 0.05), (total, client_s, segments)
