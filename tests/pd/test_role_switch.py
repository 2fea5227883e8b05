"""A PD server changes role without a restart (`--enable-pd-role-switch`, asked through the router's
`POST /pd_role_switch`): under a steady stream of requests through the router, a decode server becomes a prefill and
then a decode again; no request is lost and every greedy output equals a colocated server's, before, during and
after the switches. A switch whose drain times out is refused and the server goes on serving its old role. The
cluster has a cluster secret, as every launcher sets one."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from cluster_util import CHILD_ENV, Proc, Reply, decode_server, free_port, http, prefill_server, router, \
    start_with_router, stop_all, wait_kv_free
from pdserve.cluster_auth import HEADER, ClusterAuth
from pdserve.config import ConfigError, ServerArgs
from pdserve.scheduler.process import STEP_DELAY_ENV

pytestmark = pytest.mark.timeout(900)  # the servers start inside the test

SECRET = ("--disaggregation-secret", "role-switch-test-secret")
SWITCHABLE = "--enable-pd-role-switch"
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PROMPTS = [[(i * 31 + k * 17) % 1000 + 3 for i in range(24 + 8 * (k % 4))] for k in range(8)]
LOAD_THREADS = 3
LONG_OUTPUT = 150


@pytest.fixture(scope="module")
def cluster(tiny_model) -> Iterator[dict[str, Proc]]:
    boot_prefill, boot_steady, boot_moving = (free_port() for _ in range(3))
    prefill = prefill_server(tiny_model, "tcp", boot_prefill, SWITCHABLE, *SECRET)
    steady = decode_server(tiny_model, "tcp", SWITCHABLE, "--disaggregation-bootstrap-port", str(boot_steady),
                           *SECRET, name="decode-steady")
    steady.env = {**CHILD_ENV, STEP_DELAY_ENV: "0.02"}  # a long request stays in flight for seconds
    moving = decode_server(tiny_model, "tcp", SWITCHABLE, "--disaggregation-bootstrap-port", str(boot_moving),
                           *SECRET, name="decode-moving")
    # round robin: the switched server takes its share of prefills
    front = start_with_router([prefill, steady, moving], lambda: router(
        [(prefill, boot_prefill)], [steady, moving], *SECRET, "--prefill-policy", "round_robin",
        name="router-role-switch"))
    yield {"prefill": prefill, "steady": steady, "moving": moving, "router": front}
    stop_all([front, moving, steady, prefill])


@dataclass
class Outcome:
    prompt: int
    started: float
    ended: float
    status: int
    output_ids: list[int] | None


class Load:
    """Threads that stream the prompts through the router, one after another, until stopped."""

    def __init__(self, url: str):
        self.url = url
        self.outcomes: list[Outcome] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(n,), daemon=True) for n in range(LOAD_THREADS)]

    def run(self, first: int) -> None:
        k = first
        while not self.stop.is_set():
            started = time.monotonic()
            reply = http("POST", self.url + "/generate",
                         {"input_ids": PROMPTS[k], "sampling_params": GREEDY, "stream": True}, timeout=120)
            events = reply.events() if reply.status == 200 else []
            output = events[-1].get("output_ids") if events and "error" not in events[-1] else None
            self.outcomes.append(Outcome(k, started, time.monotonic(), reply.status, output))
            k = (k + LOAD_THREADS) % len(PROMPTS)

    def finished_after(self, moment: float) -> int:
        return sum(o.started > moment for o in list(self.outcomes))

    def wait_for(self, count: int, after: float, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.finished_after(after) < count:
            assert time.monotonic() < deadline, f"fewer than {count} requests finished in {timeout:g} s"
            time.sleep(0.05)


def switch(front: Proc, server: Proc, role: str) -> dict:
    reply = front.post("/pd_role_switch", {"worker_url": server.url, "new_role": role}, timeout=300)
    assert reply.status == 200, reply.body
    return reply.json()


def roles_in_router(front: Proc) -> dict[str, str]:
    return {w["url"]: w["role"] for w in front.get("/workers").json()["workers"]}


def received(server: Proc) -> float:
    text = server.get("/metrics").body.decode()
    return float(re.search(r"^pdserve_requests_received_total (\S+)$", text, re.M).group(1))


def mode(server: Proc) -> str:
    return server.get("/load").json()["disaggregation_mode"]


def generate(server: Proc, ids: list[int], max_new_tokens: int = GREEDY["max_new_tokens"]) -> list[int]:
    params = {**GREEDY, "max_new_tokens": max_new_tokens}
    reply = server.post("/generate", {"input_ids": ids, "sampling_params": params})
    assert reply.status == 200, reply.body
    return reply.json()["output_ids"]


def test_switching_under_load_loses_no_request_and_keeps_greedy_outputs(cluster, colocated):
    front, moving = cluster["router"], cluster["moving"]
    load = Load(front.url)
    started = time.monotonic()
    for thread in load.threads:
        thread.start()
    try:
        load.wait_for(LOAD_THREADS, after=started)
        to_prefill_at = time.monotonic()
        outcome = switch(front, moving, "prefill")
        assert outcome["outcome"] == "switched" and outcome["old_role"] == "decode", outcome
        assert mode(moving) == "prefill" and roles_in_router(front)[moving.url] == "prefill"
        served_before = received(moving)
        load.wait_for(2 * LOAD_THREADS, after=time.monotonic())  # prefilled on either prefill server now
        assert received(moving) > served_before  # it served as a prefill
        assert switch(front, moving, "decode")["outcome"] == "switched"
        back_at = time.monotonic()
        assert mode(moving) == "decode" and roles_in_router(front)[moving.url] == "decode"
        load.wait_for(LOAD_THREADS, after=back_at)
    finally:
        load.stop.set()
        for thread in load.threads:
            thread.join(150)
    outcomes = load.outcomes
    assert all(o.status == 200 and o.output_ids is not None for o in outcomes), \
        [(o.prompt, o.status) for o in outcomes if o.status != 200 or o.output_ids is None]
    expected = {k: generate(colocated, PROMPTS[k]) for k in {o.prompt for o in outcomes}}
    assert [o.output_ids for o in outcomes] == [expected[o.prompt] for o in outcomes]
    during = [o for o in outcomes if o.started < back_at and o.ended > to_prefill_at]
    assert min(o.started for o in outcomes) < to_prefill_at and during and max(o.ended for o in outcomes) > back_at
    wait_kv_free([cluster["prefill"], cluster["steady"], moving])


def signed_post(server: Proc, path: str, body: dict) -> Reply:
    """A POST signed as the router signs (a request without bootstrap fields: the decode prefills it itself)."""
    data = json.dumps(body).encode()
    return server.post(path, data, headers={HEADER: ClusterAuth(SECRET[1]).token("POST", path, data)}, timeout=120)


def test_a_role_that_cannot_start_leaves_the_server_in_its_old_role(cluster, colocated):
    steady = cluster["steady"]
    port = steady.get("/get_server_info").json()["disaggregation_bootstrap_port"]
    with socket.socket() as taken:  # the bootstrap port the prefill role would open
        taken.bind(("127.0.0.1", port))
        taken.listen()
        reply = signed_post(steady, "/pd_role_switch", {"new_role": "prefill"})
    assert reply.status == 409 and "BootstrapError" in reply.json()["error"]["message"], reply.body
    assert mode(steady) == "decode"
    assert cluster["router"].post("/generate", {"input_ids": PROMPTS[4], "sampling_params": GREEDY}).json()[
        "output_ids"] == generate(colocated, PROMPTS[4])


def test_a_switch_whose_drain_times_out_is_refused_and_the_server_keeps_serving(cluster, colocated):
    front, steady = cluster["router"], cluster["steady"]
    refused = front.post("/pd_role_switch", {"worker_url": cluster["prefill"].url, "new_role": "decode"})
    assert refused.status == 409 and "last prefill" in refused.json()["error"]["message"], refused.body
    long_body = {"input_ids": PROMPTS[1], "sampling_params": {**GREEDY, "max_new_tokens": LONG_OUTPUT}}
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(reply=signed_post(steady, "/generate", long_body)))
    thread.start()
    deadline = time.monotonic() + 60
    while steady.get("/load").json()["num_running_reqs"] == 0:  # decoding: seconds of steps still to come
        assert time.monotonic() < deadline, "the long request never started decoding"
        time.sleep(0.02)
    switch_body = {"new_role": "prefill", "drain_timeout_s": 2.0}
    switching: dict = {}
    switcher = threading.Thread(target=lambda: switching.update(reply=signed_post(steady, "/pd_role_switch",
                                                                                   switch_body)))
    switcher.start()
    short_body = {"input_ids": PROMPTS[3], "sampling_params": GREEDY}
    while (paused := signed_post(steady, "/generate", short_body)).status == 200:  # until the drain has begun
        assert switcher.is_alive(), "no request was refused while the server drained"
    assert paused.status == 503 and "switching its role" in paused.json()["error"]["message"], paused.body
    second = signed_post(steady, "/pd_role_switch", switch_body)
    assert second.status == 409 and "already under way" in second.json()["error"]["message"], second.body
    switcher.join(60)
    reply = switching["reply"]
    assert reply.status == 409 and "keeps its role" in reply.json()["error"]["message"], reply.body
    assert signed_post(steady, "/generate", short_body).json()["output_ids"] == generate(colocated, PROMPTS[3])
    assert steady.post("/pd_role_switch", switch_body).status == 401  # only the router may ask
    thread.join(120)
    assert result["reply"].status == 200, result["reply"].body
    assert result["reply"].json()["output_ids"] == generate(colocated, PROMPTS[1], LONG_OUTPUT)
    assert mode(steady) == "decode" and roles_in_router(front)[steady.url] == "decode"
    assert generate(front, PROMPTS[2]) == generate(colocated, PROMPTS[2])
    assert signed_post(steady, "/pd_role_switch", {"new_role": "colocated"}).status == 400
    not_enabled = colocated.post("/pd_role_switch", {"new_role": "prefill"})
    assert not_enabled.status == 400 and "--enable-pd-role-switch" in not_enabled.json()["error"]["message"]
    wait_kv_free([cluster["prefill"], steady, cluster["moving"]])


@pytest.mark.parametrize("flags, problem", [
    ({}, "prefill or decode"),
    ({"disaggregation_mode": "decode", "disaggregation_transfer_backend": "fake"}, "not fake"),
    ({"disaggregation_mode": "decode", "tp_size": 2}, "--tp-size 1"),
    ({"disaggregation_mode": "decode", "disaggregation_bootstrap_port": 30000}, "its own bootstrap port"),
])
def test_role_switch_flags_that_cannot_work_are_refused(flags, problem):
    with pytest.raises(ConfigError, match=problem):
        ServerArgs(model_path="m", enable_pd_role_switch=True, **flags)
