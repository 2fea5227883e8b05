"""The router in front of real pdserve processes on CPU: one prefill and two decode servers (tcp transfer).

Checks that round_robin and least_load spread requests over both decode servers (their own request counters
in /metrics), and that a decode server killed with SIGKILL leaves rotation while requests keep succeeding.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_util import Proc, decode_server, free_port, prefill_server, router, start_all, stop_all, wait_kv_free

pytestmark = pytest.mark.timeout(900)  # the first test also pays for starting the servers

BODY = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
RECEIVED = "pdserve_requests_received_total"


@pytest.fixture(scope="module")
def pd_servers(tiny_model) -> Iterator[dict]:
    model = tiny_model
    bootstrap = free_port()
    prefill = prefill_server(model, "tcp", bootstrap)
    decodes = [decode_server(model, "tcp", name=f"decode-{i}") for i in range(2)]
    start_all([prefill, *decodes])
    prefills = [(prefill, bootstrap)]
    routers = {policy: router(prefills, decodes, "--decode-policy", policy, "--health-failure-threshold", "2",
                              name=f"router-{policy}") for policy in ("round_robin", "least_load")}
    try:
        start_all(list(routers.values()))
    except BaseException:
        stop_all([prefill, *decodes])
        raise
    yield {"prefill": prefill, "decodes": decodes, "routers": routers}
    stop_all([*routers.values(), prefill, *decodes])


def received(proc: Proc) -> int:
    reply = proc.get("/metrics")
    assert reply.status == 200, reply.body
    line = next(line for line in reply.body.decode().splitlines() if line.startswith(RECEIVED + " "))
    return int(float(line.split()[1]))


def send(router_proc: Proc, count: int, concurrency: int = 1) -> None:
    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(lambda _: router_proc.post("/generate", BODY), range(count)))
    for reply in replies:
        assert reply.status == 200, reply.body
        assert len(reply.json()["output_ids"]) == 8


def test_round_robin_alternates_decode_servers(pd_servers):
    decodes, prefill = pd_servers["decodes"], pd_servers["prefill"]
    before = [received(d) for d in decodes] + [received(prefill)]
    send(pd_servers["routers"]["round_robin"], 6)
    after = [received(d) for d in decodes] + [received(prefill)]
    assert [a - b for a, b in zip(after, before)] == [3, 3, 6]
    wait_kv_free([prefill, *decodes])


def test_least_load_spreads_concurrent_requests(pd_servers):
    decodes = pd_servers["decodes"]
    before = [received(d) for d in decodes]
    send(pd_servers["routers"]["least_load"], 6, concurrency=6)
    spread = [received(d) - b for d, b in zip(decodes, before)]
    assert sum(spread) == 6 and min(spread) >= 2, spread
    wait_kv_free([pd_servers["prefill"], *decodes])


def test_killed_decode_leaves_rotation(pd_servers):
    survivor, victim = pd_servers["decodes"]
    rr = pd_servers["routers"]["round_robin"]
    victim.signal(signal.SIGKILL)
    victim.proc.wait(10)
    send(rr, 4)  # retried on the survivor while the health checks catch up
    deadline = time.monotonic() + 10
    while any(w["healthy"] for w in rr.get("/workers").json()["workers"] if w["url"] == victim.url):
        assert time.monotonic() < deadline, "the dead decode server is still in rotation"
        time.sleep(0.2)
    before = received(survivor)
    send(rr, 4)
    assert received(survivor) - before == 4
    assert rr.get("/health").status == 200
    wait_kv_free([pd_servers["prefill"], survivor])
