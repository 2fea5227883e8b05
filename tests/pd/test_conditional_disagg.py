"""Conditional disaggregation end to end: the router sends a short prompt to the decode server alone, which
prefills it itself (in chunks, alternating with the decode steps of a request running beside it); the output is
token-identical to a colocated server's (under a JSON schema too) and the router counts local and remote
prefills. The cluster has a cluster secret, as every launcher sets one: the decode server accepts the router's
signed local requests."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator

import jsonschema
import pytest
from pdserve.cluster_auth import HEADER, ClusterAuth
from cluster_util import Proc, decode_server, free_port, prefill_server, router, scheduler_stats, \
    start_with_router, stop_all, wait_kv_free

pytestmark = pytest.mark.timeout(900)  # the servers start inside the test

LOCAL_MAX_TOKENS = 40
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
SHORT_IDS = [(i * 29 + 5) % 1000 + 3 for i in range(LOCAL_MAX_TOKENS)]  # 3 local chunks of 16
LONG_IDS = [(i * 37 + 11) % 1000 + 3 for i in range(100)]
SECRET = ("--disaggregation-secret", "conditional-test-secret")


@pytest.fixture(scope="module")
def conditional_cluster(tiny_model) -> Iterator[dict[str, Proc]]:
    bootstrap = free_port()
    prefill = prefill_server(tiny_model, "tcp", bootstrap, "--chunked-prefill-size", "32", *SECRET)
    decode = decode_server(tiny_model, "tcp", "--decode-local-prefill-chunk-size", "16", *SECRET,
                           name="decode-conditional")
    front = start_with_router([prefill, decode], lambda: router(
        [(prefill, bootstrap)], [decode], "--local-prefill-max-tokens", str(LOCAL_MAX_TOKENS), *SECRET,
        name="router-conditional"))
    yield {"prefill": prefill, "decode": decode, "router": front}
    stop_all([front, decode, prefill])


def generate(proc: Proc, ids: list[int]) -> list[int]:
    reply = proc.post("/generate", {"input_ids": ids, "sampling_params": GREEDY})
    assert reply.status == 200, reply.body
    return reply.json()["output_ids"]


def counter(proc: Proc, name: str, labels: str = "") -> float:
    text = proc.get("/metrics").body.decode()
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert match, f"{name}{labels} not in {proc.name}'s /metrics"
    return float(match.group(1))


def test_local_prefill_matches_colocated_and_is_counted(conditional_cluster, colocated):
    cluster = conditional_cluster
    outputs: dict[str, list[int]] = {}

    def run(name: str, ids: list[int]) -> None:
        outputs[name] = generate(cluster["router"], ids)

    remote = threading.Thread(target=run, args=("long", LONG_IDS))
    remote.start()  # decoding on the decode server while the short prompt is prefilled there
    run("short", SHORT_IDS)
    remote.join(300)
    assert not remote.is_alive()

    assert outputs["short"] == generate(colocated, SHORT_IDS)
    assert outputs["long"] == generate(colocated, LONG_IDS)
    prefill_total = "pdserve_router_prefill_total"
    assert counter(cluster["router"], prefill_total, '{path="local"}') == 1
    assert counter(cluster["router"], prefill_total, '{path="remote"}') == 1
    assert scheduler_stats(cluster["decode"])["num_local_prefills"] == 1
    assert counter(cluster["prefill"], "pdserve_requests_received_total") == 1  # the long prompt only
    wait_kv_free([cluster["prefill"], cluster["decode"]])
    load = cluster["prefill"].get("/load").json()  # what the router reads with --local-prefill-cost-factor
    assert load["queued_prefill_tokens"] == 0 and load["num_waiting"] == 0 and load["prefill_tokens_per_s"] > 0


def test_decode_server_refuses_half_a_bootstrap(conditional_cluster):
    body = json.dumps({"input_ids": SHORT_IDS, "sampling_params": GREEDY, "bootstrap_host": "127.0.0.1"}).encode()
    token = ClusterAuth(SECRET[1]).token("POST", "/generate", body)  # signed as the router signs
    reply = conditional_cluster["decode"].post("/generate", body, headers={HEADER: token})
    assert reply.status == 400 and "bootstrap_room" in reply.json()["error"]["message"]


def test_a_json_schema_request_prefilled_on_the_decode_validates_and_matches_colocated(conditional_cluster, colocated):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
    body = {"input_ids": SHORT_IDS, "sampling_params": {"temperature": 0, "max_new_tokens": 40,
                                                        "json_schema": json.dumps(schema)}}
    front, local = conditional_cluster["router"], '{path="local"}'
    shown = f'pdserve_router_prefill_total{local}' in front.get("/metrics").body.decode()  # after a local prefill
    local_before = counter(front, "pdserve_router_prefill_total", local) if shown else 0
    got, expected = front.post("/generate", body), colocated.post("/generate", body)
    assert got.status == expected.status == 200, (got.body, expected.body)
    assert counter(front, "pdserve_router_prefill_total", local) == local_before + 1
    assert got.json()["meta_info"]["finish_reason"]["type"] == "stop"
    jsonschema.validate(json.loads(got.json()["text"]), schema)
    assert got.json()["output_ids"] == expected.json()["output_ids"]
    wait_kv_free([conditional_cluster["prefill"], conditional_cluster["decode"]])
