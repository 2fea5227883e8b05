"""The router's P:D balance (`--balance-roles`) decides from the instances' `/load`: it switches the least loaded
instance of an idle side to the busy side's role once the imbalance has lasted its window, never the last instance
of a role, one switch at a time, none within the cooldown; a refused switch leaves the instance in its old role. The
rule is checked on its own, then end to end against stub servers whose `/load` the test sets."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from pdserve_router.role_balance import BalancePolicy, BalanceWindow, Move, RoleLoad, parse_role_load

from router.conftest import RouterProcess
from tools.stub import StubHost

POLICY = BalancePolicy(prefill_wait_s=1.0, decode_step_ms=10.0, idle_pressure=0.5)


def load(mode: str, queued: int = 0, rate: float = 1000.0, step_ms: float = 5.0, running: int = 0,
         kv: float = 0.1) -> RoleLoad:
    return RoleLoad(mode, queued, rate, step_ms, running, kv)


def report(mode: str, queued: int = 0, running: int = 0, kv: float = 0.1, step_ms: float = 5.0) -> dict:
    """A `/load` answer as pdserve gives it."""
    return {"disaggregation_mode": mode, "queued_prefill_tokens": queued, "prefill_tokens_per_s": 1000.0,
            "local_prefill_tokens_per_s": 0.0, "decode_step_ms": step_ms, "num_running_reqs": running,
            "kv_usage": kv, "tpot_budget_ms": 0.0, "num_waiting": 0, "num_running": running}


BUSY_PREFILL = [("p0", load("prefill", queued=3000))]  # 3 s of queue: pressure 3


def test_a_long_prefill_queue_takes_the_least_loaded_of_idle_decodes():
    decodes = [("d0", load("decode", running=2, kv=0.3)), ("d1", load("decode", kv=0.05)),
               ("d2", load("decode", kv=0.2))]
    move = POLICY.wanted({"prefill": BUSY_PREFILL, "decode": decodes})
    assert move is not None and (move.url, move.to_role) == ("d1", "prefill")
    assert "prefill pressure 3.00" in move.reason


def test_slow_decode_steps_take_an_idle_prefill():
    prefills = [("p0", load("prefill", queued=100)), ("p1", load("prefill"))]
    decodes = [("d0", load("decode", running=40, step_ms=14.0, kv=0.5))]
    assert POLICY.wanted({"prefill": prefills, "decode": decodes}) == Move(
        "p1", "decode", "decode pressure 1.40 >= 1 while prefill pressure 0.05 <= 0.5")


def test_a_full_kv_pool_counts_as_decode_pressure():
    prefills = [("p0", load("prefill")), ("p1", load("prefill"))]
    assert POLICY.wanted({"prefill": prefills, "decode": [("d0", load("decode", kv=0.95))]}).to_role == "decode"


@pytest.mark.parametrize("decodes", [
    [("d0", load("decode"))],  # the last decode instance
    [("d0", load("decode")), ("d1", load("decode", running=3, step_ms=9.5))],  # decode side not idle (0.11, 0.95)
    [("d0", load("decode")), ("d1", None)],  # an instance whose /load did not answer
])
def test_no_switch_takes_the_last_instance_a_busy_side_or_a_blind_one(decodes):
    assert POLICY.wanted({"prefill": BUSY_PREFILL, "decode": decodes}) is None


def test_a_queue_at_an_unmeasured_rate_decides_nothing():
    prefills = [("p0", load("prefill", queued=5000, rate=0.0))]
    assert POLICY.wanted({"prefill": prefills, "decode": [("d0", load("decode")), ("d1", load("decode"))]}) is None


def test_the_window_and_the_cooldown():
    window, move = BalanceWindow(window_s=2.0, cooldown_s=10.0), Move("d1", "prefill", "busy")
    assert window.observe(0.0, move) is None
    assert window.observe(1.0, None) is None  # the imbalance broke: the window starts again
    assert window.observe(1.5, move) is None
    assert window.observe(3.0, move) is None
    assert window.observe(3.5, move) == move
    window.switch_ended(4.0)
    assert window.observe(5.0, move) is None and window.observe(13.9, move) is None  # cooldown
    assert window.observe(14.0, move) == move


def test_parse_role_load_refuses_what_is_not_a_load():
    assert parse_role_load(report("decode", running=2, kv=0.3)) == load("decode", running=2, kv=0.3)
    for bad in ({**report("decode"), "disaggregation_mode": "null"}, {**report("prefill"), "queued_prefill_tokens": -1},
                {**report("prefill"), "kv_usage": True}, {**report("prefill"), "decode_step_ms": "5"}, [], None):
        assert parse_role_load(bad) is None


@pytest.fixture
def stubs() -> Iterator[StubHost]:
    host = StubHost()
    yield host
    host.close()


def start_router(stubs: StubHost, prefills, decodes, *extra: str) -> RouterProcess:
    return RouterProcess.start(["--prefill", *(p.url for p in prefills),
                                "--prefill-bootstrap-ports", *(str(p.bootstrap_port) for p in prefills),
                                "--decode", *(d.url for d in decodes), *extra])


def test_the_router_switches_one_idle_decode_then_holds_for_the_cooldown(stubs):
    prefill = stubs.add("prefill", load=report("prefill", queued=5000))
    decodes = [stubs.add("decode", load=report("decode", kv=kv), bootstrap_port=9100 + i)
               for i, kv in enumerate((0.3, 0.05, 0.2))]
    router = start_router(stubs, [prefill], decodes, "--balance-roles", "--balance-interval-s", "0.05",
                          "--balance-window-s", "0.3", "--balance-cooldown-s", "60")
    try:
        router.wait_for(lambda: router.workers().get(decodes[1].url, {}).get("role") == "prefill")
        assert router.workers()[decodes[1].url]["bootstrap_port"] == 9101
        time.sleep(1.0)  # the prefill side is as busy and two decodes idle, but the cooldown holds
        assert [d.switches for d in decodes] == [[], ["prefill"], []]
        assert router.metric('pdserve_router_role_switches_total{outcome="switched",to_role="prefill"}') == 1
    finally:
        router.close()


def test_a_refused_switch_leaves_the_instance_in_its_role_and_the_last_one_is_never_asked(stubs):
    prefill = stubs.add("prefill", load=report("prefill"))
    decodes = [stubs.add("decode", load=report("decode"), switch_status=409) for _ in range(2)]
    router = start_router(stubs, [prefill], decodes)
    try:
        refused = router.post("/pd_role_switch", {"worker_url": decodes[0].url, "new_role": "prefill"})
        assert refused.status == 409 and refused.json()["outcome"] == "refused", refused.body
        assert router.workers()[decodes[0].url]["role"] == "decode" and decodes[0].switches == ["prefill"]
        last = router.post("/pd_role_switch", {"worker_url": prefill.url, "new_role": "decode"})
        assert last.status == 409 and "last prefill" in last.json()["error"]["message"]
        assert prefill.switches == []
        assert router.post("/pd_role_switch", {"worker_url": prefill.url, "new_role": "colocated"}).status == 400
        assert router.post("/pd_role_switch", {"worker_url": "http://127.0.0.1:1", "new_role": "decode"}).status == 404
        assert router.post("/pd_role_switch", {"url": prefill.url, "role": "decode"}).status == 400
        assert router.metric('pdserve_router_role_switches_total{outcome="refused",to_role="prefill"}') == 1
    finally:
        router.close()


def test_an_instance_switched_behind_the_routers_back_is_registered_under_its_new_role(stubs):
    prefill = stubs.add("prefill", load=report("prefill"))
    decodes = [stubs.add("decode", load=report("decode"), bootstrap_port=9200 + i) for i in range(2)]
    router = start_router(stubs, [prefill], decodes, "--balance-roles", "--balance-interval-s", "0.05")
    try:
        decodes[0].role, decodes[0].load = "prefill", report("prefill")  # as a direct POST /pd_role_switch leaves it
        router.wait_for(lambda: router.workers()[decodes[0].url]["role"] == "prefill")
        assert router.workers()[decodes[0].url]["bootstrap_port"] == 9200 and decodes[0].switches == []
        assert router.metric('pdserve_router_role_switches_total{outcome="followed",to_role="prefill"}') == 1
    finally:
        router.close()
