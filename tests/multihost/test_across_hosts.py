"""PD across three hosts (network namespaces on a bridge): greedy output equals the colocated engine for tcp and
mooncake, with every role on its own address and with --host 0.0.0.0 everywhere; a partitioned decode host
fails its request within the timeouts and the cluster serves again once the link is back; added latency
(tc netem) changes nothing."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest
from cluster_util import Proc, http, wait_kv_free
from conftest import HostCluster
from netns import ip

from pdserve import SamplingParams

pytestmark = pytest.mark.timeout(600)

MAX_NEW = 12
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "1, 2, 3, 4,"]
LONG_IDS = [(i * 37 + 11) % 1000 + 3 for i in range(100)]
CLUSTERS = ["tcp", "mooncake", "wildcard"]
# the router's --unreachable-timeout-s (3) and the servers' PD timeouts (6) bound a partitioned request
PARTITION_DEADLINE_S = 15.0


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
    prefill_host = cluster.prefill.host
    route = http("GET", f"http://{prefill_host}:{cluster.bootstrap_port}/route").json()
    assert route["ranks"]["0"]["control_endpoint"].startswith(f"{prefill_host}:")
    assert route["ranks"]["0"]["transfer_session"].startswith(f"{prefill_host}:")
