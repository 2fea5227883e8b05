"""`--local-prefill-by-load` in front of real pdserve processes on the CPU (tcp), with a cluster secret as every
launcher sets: the decode server's `/load` (with a TPOT budget) is what the router parses, a router that favours
the local path sends prompts to the decode server alone once the prefill has a measured rate, and their greedy
output equals the remote path's (a second router that never goes local)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
from cluster_util import Proc, decode_server, free_port, prefill_server, router, start_all, stop_all, wait_kv_free
from pdserve_router.conditional import parse_load

pytestmark = pytest.mark.timeout(900)  # the first test also pays for starting the servers

SECRET = ("--disaggregation-secret", "load-aware-test-secret")
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PROMPTS = [[(i * step + 7) % 1000 + 3 for i in range(length)] for step, length in ((31, 40), (17, 90), (43, 64))]
ALWAYS_LOCAL, NEVER_LOCAL = "1e9", "1e-9"  # --local-prefill-alpha: local wins whenever a decode takes it / never


@pytest.fixture(scope="module")
def cluster(tiny_model) -> Iterator[dict[str, Proc]]:
    bootstrap = free_port()
    prefill = prefill_server(tiny_model, "tcp", bootstrap, *SECRET)
    decode = decode_server(tiny_model, "tcp", "--decode-tpot-budget-ms", "1000", "--decode-local-prefill-chunk-size",
                           "32", *SECRET, name="decode-by-load")
    start_all([prefill, decode])
    routers = {alpha: router([(prefill, bootstrap)], [decode], "--local-prefill-by-load", "--local-prefill-alpha",
                             alpha, *SECRET, name=f"router-alpha-{alpha}") for alpha in (ALWAYS_LOCAL, NEVER_LOCAL)}
    try:
        start_all(list(routers.values()))
    except BaseException:
        stop_all([prefill, decode])
        raise
    yield {"prefill": prefill, "decode": decode, **routers}
    stop_all([*routers.values(), prefill, decode])


def generate(proc: Proc, ids: list[int]) -> list[int]:
    reply = proc.post("/generate", {"input_ids": ids, "sampling_params": GREEDY})
    assert reply.status == 200, reply.body
    return reply.json()["output_ids"]


def prefills(proc: Proc) -> dict[str, float]:
    text = proc.get("/metrics").body.decode()
    return {path: float(count) for path, count in re.findall(r'^pdserve_router_prefill_total\{path="(\w+)"\} (\S+)$',
                                                               text, re.M)}


def wait_for_measured_prefill(front: Proc, prefill_url: str, timeout: float = 10.0) -> None:
    """Until the router has read a measured prefill rate (an unmeasured prefill keeps every prompt remote)."""
    deadline = time.monotonic() + timeout
    while True:
        workers = {w["url"]: w for w in front.get("/workers").json()["workers"]}
        if workers[prefill_url].get("load", {}).get("prefill_tokens_per_s", 0) > 0:
            return
        assert time.monotonic() < deadline, f"the router never read a measured prefill rate: {workers}"
        time.sleep(0.05)


def test_a_decode_servers_load_offers_a_budget_when_idle(cluster):
    load = parse_load(cluster["decode"].get("/load").json())
    assert load is not None and load.local_tokens_per_s > 0 and 0 <= load.kv_usage < 0.9
    assert parse_load(cluster["prefill"].get("/load").json()) is not None


def test_prompts_prefilled_on_the_decode_equal_the_remote_path(cluster):
    remote = [generate(cluster[NEVER_LOCAL], ids) for ids in PROMPTS]  # also gives the prefill a measured rate
    assert prefills(cluster[NEVER_LOCAL]) == {"remote": len(PROMPTS)}
    front = cluster[ALWAYS_LOCAL]
    wait_for_measured_prefill(front, cluster["prefill"].url)
    local = [generate(front, ids) for ids in PROMPTS]
    assert local == remote
    assert prefills(front) == {"local": len(PROMPTS)}
    wait_kv_free([cluster["prefill"], cluster["decode"]])
