"""A grammar that compiles on the prefill but times out on the decode (started with --grammar-compile-timeout-s
0.05; the schema takes about a second to compile), through the router: the client gets the decode's 400 at once,
the router aborts the prefill's half (its pages are free well before its bootstrap timeout of 6 s), and the cluster
keeps serving, constrained requests included."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import jsonschema
import pytest
from cluster_util import PDCluster, decode_server, free_port, prefill_server, router, start_all, stop_all, \
    wait_kv_free

pytestmark = pytest.mark.timeout(600)  # the servers start inside the test

SLOW = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 30 + i} for i in range(80)},
        "required": [f"p{i}" for i in range(80)]}  # ~1 s to compile on the CPU, 10x the scheduler's idle poll
SCHEMA = {"type": "object", "properties": {"size": {"enum": ["s", "m", "l"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["size", "n"]}


@pytest.fixture(scope="module")
def slow_decode_cluster(tiny_model) -> Iterator[PDCluster]:
    bootstrap = free_port()
    prefill = prefill_server(tiny_model, "tcp", bootstrap)
    decode = decode_server(tiny_model, "tcp", "--grammar-compile-timeout-s", "0.05", name="decode-slow-grammar")
    start_all([prefill, decode])
    front = router([(prefill, bootstrap)], [decode], name="router-slow-grammar")
    try:
        start_all([front])
    except BaseException:
        stop_all([prefill, decode])
        raise
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
    wait_kv_free(cluster.servers, timeout=3)  # the router's abort, not the prefill's 6 s bootstrap timeout
    metrics = cluster.router.get("/metrics").body.decode()
    assert re.search(r'^pdserve_router_aborts_total\{role="prefill"\} 1\.0$', metrics, re.M), metrics
    free = cluster.router.post("/generate", body(ignore_eos=True, max_new_tokens=8))
    assert free.status == 200 and len(free.json()["output_ids"]) == 8
    deadline = time.monotonic() + 20
    while (again := cluster.router.post("/generate", body(json_schema=json.dumps(SCHEMA)))).status != 200:
        # the decode compiles one grammar at a time: this one times out too until SLOW's compile has ended
        assert again.status == 400 and time.monotonic() < deadline, again.body
        time.sleep(0.2)
    jsonschema.validate(json.loads(again.json()["text"]), SCHEMA)
    wait_kv_free(cluster.servers)
