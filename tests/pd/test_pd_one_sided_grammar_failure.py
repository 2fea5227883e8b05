"""A grammar that compiles on one side of a PD pair only (the other started with --grammar-compile-timeout-s 0.05;
the schema takes about a second to compile).

- It times out on the decode, through the router: the client gets the decode's 400 at once, the router (or the
  decode itself) aborts the prefill's half (its pages are free well before its bootstrap timeout of 30 s), and the
  cluster keeps serving, constrained requests included.
- It times out on the decode, without a router: the decode tells the prefill over their control channel (`abort` for
  the room, with its 400), so the prefill answers its own HTTP request with the decode's 400 at once, whether the
  request reached it after the decode's failure or before.
- It times out on the prefill, without a router (a client that pairs the halves itself): the prefill tells the decode
  over their control channel (`failed` for the room), so the decode ends its half with the prefill's 400 and frees
  its pages at once, not after its KV-transfer timeout."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from cluster_util import PDCluster, Proc, decode_server, free_port, prefill_server, router, scheduler_stats, start_all, \
    start_with_router, stop_all, wait_kv_free

pytestmark = pytest.mark.timeout(600)  # the servers start inside the test

SLOW = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 30 + i} for i in range(80)},
        "required": [f"p{i}" for i in range(80)]}  # ~1 s to compile on the CPU, 10x the scheduler's idle poll
SCHEMA = {"type": "object", "properties": {"size": {"enum": ["s", "m", "l"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["size", "n"]}


LONG_PD_TIMEOUTS = ["--disaggregation-bootstrap-timeout", "30", "--disaggregation-waiting-timeout", "30"]


@pytest.fixture(scope="module")
def slow_decode_cluster(tiny_model) -> Iterator[PDCluster]:
    """A plain prefill that waits 30 s for its peer's claim (flags last win) and a decode whose compiles time out."""
    bootstrap = free_port()
    prefill = prefill_server(tiny_model, "tcp", bootstrap, *LONG_PD_TIMEOUTS)
    decode = decode_server(tiny_model, "tcp", "--grammar-compile-timeout-s", "0.05", name="decode-slow-grammar")
    front = start_with_router([prefill, decode], lambda: router(
        [(prefill, bootstrap)], [decode], name="router-slow-grammar"))
    yield PDCluster("tcp", prefill, bootstrap, decode, front)
    stop_all([front, decode, prefill])


def body(**params) -> dict:
    return {"text": "The weather in", "sampling_params": {"temperature": 0, "max_new_tokens": 40, **params}}


def test_a_compile_timing_out_on_the_decode_only_is_a_400_and_frees_both_pools(slow_decode_cluster):
    cluster = slow_decode_cluster
    started = time.monotonic()
    reply = cluster.router.post("/generate", body(json_schema=json.dumps(SLOW)))
    assert reply.status == 400, reply.body
    assert "did not compile within 0.05 s" in reply.body.decode()
    assert time.monotonic() - started < 5
    wait_kv_free(cluster.servers, timeout=10)  # an abort, not the prefill's 30 s bootstrap timeout
    router_metrics, prefill_metrics = (proc.get("/metrics").body.decode() for proc in (cluster.router, cluster.prefill))
    # whichever came first ended the prefill's half (it was still compiling the schema): the router's abort, or the
    # decode's own over the control channel
    assert re.search(r'^pdserve_router_aborts_total\{role="prefill"\} 1\.0$', router_metrics, re.M) or \
        re.search(r'^pdserve_kv_transfer_failures_total\{reason="peer_aborted",role="prefill"\} 1\.0$',
                  prefill_metrics, re.M), (router_metrics, prefill_metrics)
    free = cluster.router.post("/generate", body(ignore_eos=True, max_new_tokens=8))
    assert free.status == 200 and len(free.json()["output_ids"]) == 8
    deadline = time.monotonic() + 20
    while (again := cluster.router.post("/generate", body(json_schema=json.dumps(SCHEMA)))).status != 200:
        # the decode compiles one grammar at a time: this one times out too until SLOW's compile has ended
        assert again.status == 400 and time.monotonic() < deadline, again.body
        time.sleep(0.2)
    jsonschema.validate(json.loads(again.json()["text"]), SCHEMA)
    wait_kv_free(cluster.servers)


def slow_variant(n: int) -> dict:
    """SLOW with other bounds: compiled by no server yet, so it takes its second again (and times out on the decode)."""
    return {**SLOW, "properties": {f"p{i}": {"type": "string", "maxLength": 30 + i + n} for i in range(80)}}


def timed_post(proc: Proc, request: dict) -> tuple:
    started = time.monotonic()
    reply = proc.post("/generate", request)
    return reply, time.monotonic() - started


def bootstrapping(prefill: Proc) -> int:
    """Requests the prefill holds that wait for their decode's claim."""
    return scheduler_stats(prefill)["kv_transfer"]["queues"]["bootstrap"]


@pytest.mark.parametrize("decode_first", [True, False], ids=["decode-fails-first", "prefill-waits-first"])
def test_a_compile_failing_on_the_decode_only_ends_the_prefills_half_at_once(slow_decode_cluster, decode_first):
    cluster = slow_decode_cluster
    prefill, decode = cluster.prefill, cluster.decode
    room = 5321 + decode_first
    request = {**body(json_schema=json.dumps(slow_variant(1 + decode_first))), "bootstrap_host": "127.0.0.1",
               "bootstrap_port": cluster.bootstrap_port, "bootstrap_room": room}
    with ThreadPoolExecutor(1) as pool:
        if decode_first:  # the decode's 400 came back: its abort is out before the prefill has the request
            decode_reply = decode.post("/generate", request)
            prefill_reply, prefill_s = timed_post(prefill, request)
        else:  # the prefill compiled the schema (about 1 s) and waits for the decode's claim
            prefill_half = pool.submit(timed_post, prefill, request)
            deadline = time.monotonic() + 20
            while not bootstrapping(prefill):
                assert time.monotonic() < deadline and not prefill_half.done(), "the prefill never waited for a claim"
                time.sleep(0.05)
            started = time.monotonic()
            decode_reply = decode.post("/generate", request)
            prefill_reply, _ = prefill_half.result(timeout=30)
            prefill_s = time.monotonic() - started
    assert decode_reply.status == 400 and "did not compile within 0.05 s" in decode_reply.body.decode()
    message = prefill_reply.json()["error"]["message"]
    assert prefill_reply.status == 400 and "aborted by the decode server" in message, prefill_reply.body
    assert "did not compile within 0.05 s" in message
    assert prefill_s < 20, prefill_s  # (its own compile, about 1 s,) then the decode's word: not its 30 s timeout
    wait_kv_free(cluster.servers, timeout=10)
    pair = {"bootstrap_host": "127.0.0.1", "bootstrap_port": cluster.bootstrap_port, "bootstrap_room": room + 10}
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda proc: proc.post("/generate", {**body(ignore_eos=True, max_new_tokens=4), **pair}),
                                (prefill, decode)))
    assert [r.status for r in replies] == [200, 200] and len(replies[1].json()["output_ids"]) == 4


@pytest.fixture(scope="module")
def slow_prefill_pair(tiny_model) -> Iterator[tuple[Proc, int, Proc]]:
    """A prefill whose compiles time out and a plain decode, both waiting 30 s for their peer (flags last win)."""
    bootstrap = free_port()
    prefill = prefill_server(tiny_model, "tcp", bootstrap, "--grammar-compile-timeout-s", "0.05", *LONG_PD_TIMEOUTS)
    decode = decode_server(tiny_model, "tcp", *LONG_PD_TIMEOUTS, name="decode-long-timeouts")
    start_all([prefill, decode])
    yield prefill, bootstrap, decode
    stop_all([decode, prefill])


def test_a_compile_failing_on_the_prefill_only_ends_the_decodes_half_at_once(slow_prefill_pair):
    prefill, bootstrap, decode = slow_prefill_pair
    pair = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": 4321}

    def timed(proc: Proc) -> tuple:
        started = time.monotonic()
        reply = proc.post("/generate", {**body(json_schema=json.dumps(SLOW)), **pair})
        return reply, time.monotonic() - started

    with ThreadPoolExecutor(2) as pool:
        (prefill_reply, _), (decode_reply, decode_s) = pool.map(timed, (prefill, decode))
    assert prefill_reply.status == 400 and "did not compile within 0.05 s" in prefill_reply.body.decode()
    assert decode_reply.status == 400, decode_reply.body
    assert "did not compile within 0.05 s" in decode_reply.json()["error"]["message"]
    assert decode_s < 20, decode_s  # its own compile (about 1 s), then the prefill's word: not its 30 s timeout
    wait_kv_free([prefill, decode], timeout=10)
    paired = {**body(ignore_eos=True, max_new_tokens=4), **pair, "bootstrap_room": 4322}
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda proc: proc.post("/generate", paired), (prefill, decode)))
    assert [r.status for r in replies] == [200, 200] and len(replies[1].json()["output_ids"]) == 4
