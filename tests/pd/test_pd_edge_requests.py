"""Requests at the edges, through real routers (colocated and PD) and servers: a request for no new token gets the
colocated answer through PD, a huge request id a fast 400, and a client that closes right after `[DONE]` is no
"went away" in any log."""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Iterator

import pytest
from cluster_util import PDCluster, Proc, http, regular_router, router, start_all, stop_all, wait_kv_free

pytestmark = pytest.mark.timeout(900)  # the first test also pays for starting the servers

PROMPT = "The capital of France is"
PROMPT_ONLY = {"text": PROMPT, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
               "sampling_params": {"temperature": 0, "max_new_tokens": 0}}
HUGE_RIDS = {"1 MB": "r" * (1 << 20), "long": "r" * 600}
WENT_AWAY = "went away"


@pytest.fixture(scope="module")
def routers(session_servers, tcp_cluster: PDCluster) -> Iterator[dict[str, Proc]]:
    """Routers logging at info: one in front of the colocated server, one in front of the tcp PD pair."""
    colocated_router = regular_router([session_servers["colocated"]], "--log-level", "info")
    pd_router = router([(tcp_cluster.prefill, tcp_cluster.bootstrap_port)], [tcp_cluster.decode],
                       "--log-level", "info", name="router-pd-info")
    start_all([colocated_router, pd_router])
    yield {"colocated": colocated_router, "pd": pd_router}
    stop_all([colocated_router, pd_router])


@pytest.fixture(autouse=True)
def pools_free_after(session_servers, tcp_cluster: PDCluster):
    yield
    wait_kv_free([session_servers["colocated"], *tcp_cluster.servers])


def prompt_only_answer(proc: Proc, **fields) -> dict:
    reply = proc.post("/generate", {**PROMPT_ONLY, **fields})
    assert reply.status == 200, reply.body
    return reply.json()


def test_no_new_token_through_pd_answers_as_colocated(tcp_cluster: PDCluster, colocated: Proc):
    expected, answer = prompt_only_answer(colocated), prompt_only_answer(tcp_cluster.router)
    assert answer["output_ids"] == expected["output_ids"] == [] and answer["text"] == ""
    meta, expected_meta = answer["meta_info"], expected["meta_info"]
    assert meta["finish_reason"] == expected_meta["finish_reason"] == {"type": "length"}
    assert meta["prompt_tokens"] == expected_meta["prompt_tokens"] > 1 and meta["completion_tokens"] == 0
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert meta["input_token_logprobs"] == expected_meta["input_token_logprobs"]
    assert meta["input_top_logprobs"] == expected_meta["input_top_logprobs"]


def test_no_new_token_batch_through_pd_answers_as_colocated(tcp_cluster: PDCluster, colocated: Proc):
    batch = {"text": [PROMPT, "Once upon a time"]}
    answers, expected = prompt_only_answer(tcp_cluster.router, **batch), prompt_only_answer(colocated, **batch)
    got = [a["meta_info"]["input_token_logprobs"] for a in answers]
    want = [e["meta_info"]["input_token_logprobs"] for e in expected]
    # the same tokens; the values as float32 gives them whether the decode prefills both prompts in one forward or
    # (one arriving a step later) in two, which round differently
    assert [[entry[1:] for entry in prompt] for prompt in got] == [[entry[1:] for entry in prompt] for prompt in want]
    assert [[entry[0] for entry in prompt] for prompt in got] == \
        [[None if entry[0] is None else pytest.approx(entry[0], abs=1e-4) for entry in prompt] for prompt in want]
    assert [a["output_ids"] for a in answers] == [[], []]


def test_no_new_token_streamed_through_pd_ends_as_colocated(tcp_cluster: PDCluster, colocated: Proc):
    def last_event(proc: Proc) -> dict:
        reply = proc.post("/generate", {**PROMPT_ONLY, "stream": True})
        assert reply.status == 200, reply.body
        return reply.events()[-1]

    answer, expected = last_event(tcp_cluster.router), last_event(colocated)
    assert answer["output_ids"] == [] and answer["meta_info"]["finish_reason"] == {"type": "length"}
    assert answer["meta_info"]["input_token_logprobs"] == expected["meta_info"]["input_token_logprobs"]


@pytest.mark.parametrize("size", HUGE_RIDS)
@pytest.mark.parametrize("mode", ["colocated", "pd"])
def test_a_huge_rid_gets_a_fast_400_from_a_real_router(routers, mode, size):
    body = {"text": PROMPT, "rid": HUGE_RIDS[size], "sampling_params": {"max_new_tokens": 4}}
    started = time.monotonic()
    reply = http("POST", routers[mode].url + "/generate", body, timeout=5)
    assert time.monotonic() - started < 5
    assert reply.status == 400, reply.body[:300]
    assert "'rid' is longer than" in reply.json()["error"]["message"]


def stream_and_reset(url: str, rid: str, until: bytes, max_new_tokens: int) -> None:
    """A raw client streams a /generate from `url`, reads up to `until` and resets the connection at once."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"text": PROMPT, "rid": rid, "stream": True,
                       "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-Id: %s\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (rid.encode(), len(body), body))
        received = b""
        while until not in received:
            chunk = sock.recv(65536)
            assert chunk, received[-300:]
            received += chunk
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, not FIN


def went_away_lines(proc: Proc) -> list[str]:
    return [line for line in proc.log().splitlines() if WENT_AWAY in line]


def test_a_client_that_closes_right_after_done_is_not_logged_as_gone(routers, colocated: Proc, tcp_cluster):
    servers = [colocated, tcp_cluster.decode]
    before = {proc.name: went_away_lines(proc) for proc in servers}
    targets = {"server": colocated, **routers}
    for mode, target in targets.items():
        stream_and_reset(target.url, f"done-{mode}", b"data: [DONE]", 4)
    time.sleep(0.5)  # the end of each stream and any log line it would bring
    assert {proc.name: went_away_lines(proc) for proc in servers} == before
    assert [line for r in routers.values() for line in went_away_lines(r) if "done-" in line] == []


@pytest.mark.parametrize("mode", ["colocated", "pd"])
def test_a_client_that_leaves_mid_stream_is_logged_as_gone(routers, mode):
    stream_and_reset(routers[mode].url, f"gone-{mode}", b"data: {", 200)
    deadline = time.monotonic() + 10
    while not [line for line in went_away_lines(routers[mode]) if f"gone-{mode}" in line]:
        assert time.monotonic() < deadline, routers[mode].log()[-2000:]
        time.sleep(0.1)
