"""PD across three hosts (network namespaces on a bridge): greedy output equals the colocated engine for tcp and
mooncake, with every role on its own address and with --host 0.0.0.0 everywhere (all with one cluster secret,
which a PD server other hosts reach needs); a partitioned decode host fails its request within the timeouts and the
cluster serves again once the link is back; added latency (tc netem) changes nothing."""

from __future__ import annotations

import json
import subprocess
import time
from http.client import HTTPConnection
from urllib.parse import urlsplit

import pytest
from cluster_util import CONTEXT_LENGTH, Proc, http, wait_kv_free
from hosts import CLUSTER_SECRET, HostCluster

from pdserve import SamplingParams
from pdserve.cluster_auth import HEADER, ClusterAuth

pytestmark = pytest.mark.timeout(600)

MAX_NEW = 12
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "1, 2, 3, 4,"]
LONG_IDS = [(i * 37 + 11) % 1000 + 3 for i in range(100)]
CLUSTERS = ["tcp", "mooncake", "wildcard"]
# the router's --unreachable-timeout-s (3) and the servers' PD timeouts (6) bound a partitioned request
PARTITION_DEADLINE_S = 15.0
LONG_GENERATION = 480  # tokens: still streaming when the link goes down


@pytest.fixture(params=CLUSTERS)
def cluster(request, clusters) -> HostCluster:
    if request.param not in clusters:
        pytest.skip("mooncake.engine cannot be imported (pip install mooncake-transfer-engine-non-cuda)")
    return clusters[request.param]


def expected_ids(llm, prompts: list, max_new: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def generate_ids(router: Proc, prompt, max_new: int = MAX_NEW) -> list[int]:
    key = "input_ids" if isinstance(prompt, list) else "text"
    reply = router.post("/generate", {key: prompt, "sampling_params": {**GREEDY, "max_new_tokens": max_new}})
    assert reply.status == 200, reply.body
    return reply.json()["output_ids"]


def test_pd_across_hosts_equals_colocated(cluster: HostCluster, offline_llm):
    prompts = [*PROMPTS, LONG_IDS]
    got = [generate_ids(cluster.router, p) for p in prompts]
    assert got == expected_ids(offline_llm, prompts)
    wait_kv_free([cluster.prefill, cluster.decode])


def test_bootstrap_route_names_the_prefill_host(cluster: HostCluster):
    """A route lookup from another host is answered with the prefill's address on the way to it, never a
    wildcard or loopback one (the prefill itself registered 0.0.0.0 in the wildcard cluster)."""
    prefill_host = urlsplit(cluster.prefill.url).hostname
    signed = {HEADER: ClusterAuth(CLUSTER_SECRET).token("GET", "/route")}
    route = http("GET", f"http://{prefill_host}:{cluster.bootstrap_port}/route", headers=signed).json()
    assert route["ranks"]["0"]["control_endpoint"].startswith(f"{prefill_host}:")
    assert route["ranks"]["0"]["transfer_session"].startswith(f"{prefill_host}:")


def stream_until_partition(router: Proc, partition: callable) -> tuple[float, list]:
    """Streams a long generation; after its first token arrives, calls `partition`. Returns the seconds from the
    partition to the end of the response and its SSE events."""
    conn = HTTPConnection(urlsplit(router.url).netloc, timeout=60)
    body = {"text": "Partition me", "stream": True, "return_logprob": True, "top_logprobs_num": 20,  # slower steps
            "sampling_params": {**GREEDY, "max_new_tokens": LONG_GENERATION}}
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    events, cut_at = [], None
    try:
        for line in resp:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                events.append(json.loads(line[6:]))
                if cut_at is None:
                    partition()
                    cut_at = time.monotonic()
    finally:
        conn.close()
    assert cut_at is not None, f"the stream ended before its first token: {events}"
    return time.monotonic() - cut_at, events


def wait_in_rotation(cluster: HostCluster, within_s: float = 60.0) -> None:
    """Until the router has every instance in rotation again: the clusters share the hosts, so a cut made for one
    cluster also fails the other cluster's health probes, and a request dispatched then would meet a 503."""
    deadline = time.monotonic() + within_s
    while True:
        workers = http("GET", f"{cluster.router.url}/workers").json()["workers"]
        if all(w["healthy"] and w["circuit"] == "closed" for w in workers):
            return
        assert time.monotonic() < deadline, f"instances still out of rotation after {within_s} s: {workers}"
        time.sleep(0.5)


def serves_again(cluster: HostCluster, expected: list[int], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while True:
        reply = cluster.router.post("/generate", {"text": PROMPTS[0], "sampling_params": GREEDY}, timeout=30)
        if reply.status == 200:
            assert reply.json()["output_ids"] == expected
            return
        assert time.monotonic() < deadline, f"not serving {within_s} s after the link came back: {reply.body}"
        time.sleep(0.5)


@pytest.mark.parametrize("name", ["tcp", "mooncake"])
def test_partitioned_decode_fails_fast_and_cluster_heals(name, clusters, network, offline_llm):
    """`ip link set <decode veth> down` mid-stream: the request ends with an error within the timeouts instead
    of hanging; once the link is back the same processes serve correct output again."""
    if name not in clusters:
        pytest.skip("mooncake.engine cannot be imported")
    cluster = clusters[name]
    for _ in range(3):  # a stream whose last byte left the decode host before the cut proves nothing: again
        wait_in_rotation(cluster)
        try:
            elapsed, events = stream_until_partition(cluster.router, lambda: network.partition("decode", True))
        finally:
            network.partition("decode", False)
        if not events[-1].get("meta_info", {}).get("completion_tokens") == LONG_GENERATION:
            break
        serves_again(cluster, expected_ids(offline_llm, [PROMPTS[0]])[0], within_s=30)
    assert elapsed < PARTITION_DEADLINE_S, f"the partitioned request took {elapsed:.1f} s to end"
    assert "error" in events[-1], f"a partitioned stream ended without an error: {events[-1]}"
    serves_again(cluster, expected_ids(offline_llm, [PROMPTS[0]])[0], within_s=30)
    wait_kv_free([cluster.prefill, cluster.decode], timeout=60)


@pytest.fixture
def delayed_links(network):
    """2 ms more on the prefill's and the decode's link (tc netem), removed afterwards."""
    veths = [network.hosts[role].veth for role in ("prefill", "decode")]
    added = []
    try:
        for veth in veths:
            made = subprocess.run(["tc", "qdisc", "add", "dev", veth, "root", "netem", "delay", "2ms"],
                                  capture_output=True, text=True, timeout=30)
            if made.returncode != 0:
                pytest.skip(f"this kernel refuses tc netem (CONFIG_NET_SCH_NETEM): {made.stderr.strip()}")
            added.append(veth)
        yield
    finally:
        for veth in added:
            subprocess.run(["tc", "qdisc", "del", "dev", veth, "root"], capture_output=True, timeout=30)


def test_added_latency_keeps_output_correct(cluster: HostCluster, delayed_links, offline_llm):
    prompts = [PROMPTS[1], LONG_IDS]
    assert [generate_ids(cluster.router, p) for p in prompts] == expected_ids(offline_llm, prompts)
    wait_kv_free([cluster.prefill, cluster.decode])


@pytest.mark.parametrize("name", ["tcp", "mooncake"])
def test_decode_partitioned_before_its_first_token(name, clusters, network, offline_llm):
    """The link goes down as the request is dispatched (handshake, prefill or KV transfer in flight): the request
    ends with an error within the timeouts, the prefill frees its pages, and the cluster serves again."""
    if name not in clusters:
        pytest.skip("mooncake.engine cannot be imported")
    cluster = clusters[name]
    wait_in_rotation(cluster)
    conn = HTTPConnection(urlsplit(cluster.router.url).netloc, timeout=60)
    # the longest answer the context allows (412 tokens), so the request is still in flight when the link goes down
    body = {"input_ids": LONG_IDS, "sampling_params": {**GREEDY, "max_new_tokens": CONTEXT_LENGTH - len(LONG_IDS)}}
    try:
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        network.partition("decode", True)
        cut_at = time.monotonic()
        resp = conn.getresponse()
        answer = resp.read()
        elapsed = time.monotonic() - cut_at
    finally:
        network.partition("decode", False)
        conn.close()
    assert resp.status >= 500, answer
    assert elapsed < PARTITION_DEADLINE_S, f"the partitioned request took {elapsed:.1f} s to end"
    print(f"partitioned before the first token: {resp.status} after {elapsed:.2f} s: {answer[:200]}")
    serves_again(cluster, expected_ids(offline_llm, [PROMPTS[0]])[0], within_s=30)
    wait_kv_free([cluster.prefill, cluster.decode], timeout=60)
