"""Health checks, retries with a new pair, abort of the other half, timeouts and fail-fast errors."""

from __future__ import annotations

import time

from cluster_util import free_port


def test_killed_decode_leaves_rotation_and_comes_back(stubs, start_router):
    p1, d1, d2 = stubs.add("prefill"), stubs.add("decode"), stubs.add("decode")
    router = start_router("--prefill", p1.url, "--decode", d1.url, d2.url, "--decode-policy", "round_robin")
    stubs.stop(d1)
    for i in range(6):  # before the health checker notices, a refused connection is retried on the other decode
        assert router.post("/generate", {"text": f"q{i}", "stream": i % 2 == 0}).status == 200
    router.wait_for(lambda: not router.workers()[d1.url]["healthy"])
    retries = router.metric("pdserve_router_retries_total")
    served_before = len(d2.requests)
    for i in range(6):
        assert router.post("/generate", {"text": f"r{i}"}).status == 200
    assert len(d2.requests) - served_before == 6 and router.metric("pdserve_router_retries_total") == retries
    stubs.restart(d1)
    router.wait_for(lambda: router.workers()[d1.url]["healthy"])
    for i in range(4):
        assert router.post("/generate", {"text": f"s{i}"}).status == 200
    assert len(d1.requests) == 2


def test_prefill_500_is_retried_on_a_new_pair_and_its_decode_half_aborted(stubs, start_router):
    bad, good = stubs.add("prefill", fail_status=500, delay_s=0.2), stubs.add("prefill")
    d1 = stubs.add("decode")
    router = start_router("--prefill", bad.url, good.url, "--decode", d1.url, "--prefill-policy", "round_robin")
    for stream in (False, True):
        reply = router.post("/generate", {"text": "hi", "stream": stream}, headers={"X-Request-Id": f"req-{stream}"})
        assert reply.status == 200 and reply.headers["X-Request-Id"] == f"req-{stream}"
        first, retry = d1.requests[-2]["body"], d1.requests[-1]["body"]
        assert first["rid"] == f"req-{stream}" and retry["rid"] == f"req-{stream}.r1"
        assert first["bootstrap_room"] != retry["bootstrap_room"]
        router.wait_for(lambda: f"req-{stream}" in d1.aborted, timeout=2)
        assert f"req-{stream}.r1" not in d1.aborted
    assert len(bad.requests) == 2 and len(good.requests) == 2
    assert router.metric("pdserve_router_retries_total") == 2
    assert router.metric('pdserve_router_aborts_total{role="decode"}') == 2


def test_failed_handoff_blames_the_other_half(stubs, start_router):
    """A decode's 502 (pdserve's answer when the prefill side of a handoff failed) leaves that decode healthy and
    in rotation; the retry avoids the prefill of the failed pair. Out of attempts, the client gets the upstream's
    own message."""
    p1, p2 = stubs.add("prefill"), stubs.add("prefill")
    peer_failed, good = stubs.add("decode", fail_status=502), stubs.add("decode")
    router = start_router("--prefill", p1.url, p2.url, "--decode", peer_failed.url, good.url,
                          "--decode-policy", "round_robin", "--cb-failure-threshold", "1", "--cb-open-duration-s", "60")
    for i in range(4):
        reply = router.post("/generate", {"text": "hi"}, headers={"X-Request-Id": f"h{i}"})
        assert reply.status == 200 and reply.json()["served_by"] == good.name, reply.body
    rids = {p.name: {r["body"]["rid"] for r in p.requests} for p in (p1, p2)}
    retried = [i for i in range(4) if any(f"h{i}.r1" in got for got in rids.values())]
    assert len(retried) >= 2  # round robin sends every other first attempt to the failing decode
    for i in retried:
        assert [f"h{i}" in got for got in rids.values()] != [f"h{i}.r1" in got for got in rids.values()]
    assert router.workers()[peer_failed.url]["circuit"] == "closed"

    lone = start_router("--prefill", p1.url, "--decode", peer_failed.url, "--max-retries", "0")
    reply = lone.post("/generate", {"text": "hi"})
    assert reply.status == 502
    assert f"stub {peer_failed.name} fails on purpose" in reply.json()["error"]["message"]


def test_decode_500_aborts_the_running_prefill_half(stubs, start_router):
    p1, p2 = stubs.add("prefill", delay_s=0.5), stubs.add("prefill", delay_s=0.5)
    bad, good = stubs.add("decode", fail_status=500), stubs.add("decode")
    router = start_router("--prefill", p1.url, p2.url, "--decode", bad.url, good.url, "--decode-policy", "round_robin")
    reply = router.post("/generate", {"text": "hi"}, headers={"X-Request-Id": "dec500"})
    assert reply.status == 200 and reply.json()["served_by"] == good.name
    router.wait_for(lambda: "dec500" in p1.aborted + p2.aborted, timeout=2)


def test_all_decodes_down_fails_fast_with_a_clear_message(stubs, start_router):
    p1, d1, d2 = stubs.add("prefill"), stubs.add("decode"), stubs.add("decode")
    router = start_router("--prefill", p1.url, "--decode", d1.url, d2.url)
    stubs.stop(d1)
    stubs.stop(d2)
    started = time.monotonic()
    reply = router.post("/generate", {"text": "hi"})
    assert reply.status in (502, 503) and "decode" in reply.json()["error"]["message"]
    assert time.monotonic() - started < 2.0
    router.wait_for(lambda: not any(w["healthy"] for w in router.workers().values() if w["role"] == "decode"))
    started = time.monotonic()
    reply = router.post("/generate", {"text": "hi", "stream": True})
    assert reply.status == 503 and time.monotonic() - started < 0.5
    assert reply.json()["error"]["message"].startswith("no healthy decode instance available")
    assert router.get("/health").status == 503


def test_per_request_timeout_gives_504_and_aborts_both_halves(stubs, start_router):
    p1, d1 = stubs.add("prefill", delay_s=5.0), stubs.add("decode")
    router = start_router("--prefill", p1.url, "--decode", d1.url, "--request-timeout-s", "0.5")
    started = time.monotonic()
    reply = router.post("/generate", {"text": "hi"}, headers={"X-Request-Id": "slow"})
    assert reply.status == 504 and "timed out" in reply.json()["error"]["message"]
    assert time.monotonic() - started < 2.0
    router.wait_for(lambda: "slow" in d1.aborted and "slow" in p1.aborted, timeout=2)


def test_unhealthy_instance_without_crash_is_taken_out(stubs, start_router):
    p1, d1, d2 = stubs.add("prefill"), stubs.add("decode"), stubs.add("decode")
    router = start_router("--prefill", p1.url, "--decode", d1.url, d2.url, "--decode-policy", "round_robin")
    d2.healthy = False
    router.wait_for(lambda: not router.workers()[d2.url]["healthy"])
    for i in range(4):
        assert router.post("/generate", {"text": f"q{i}"}).status == 200
    assert len(d2.requests) == 0 and len(d1.requests) == 4


def test_circuit_breaker_opens_after_repeated_failures(stubs, start_router):
    p1, bad, good = stubs.add("prefill"), stubs.add("decode", fail_status=503), stubs.add("decode")
    router = start_router("--prefill", p1.url, "--decode", bad.url, good.url, "--decode-policy", "round_robin",
                          "--cb-failure-threshold", "2", "--cb-open-duration-s", "60")
    for i in range(8):
        assert router.post("/generate", {"text": f"q{i}"}).status == 200
    assert router.workers()[bad.url]["circuit"] == "open"
    assert len(bad.requests) == 2


def test_health_waits_for_a_passed_check_of_every_role(stubs, start_router):
    p1 = stubs.add("prefill")
    dead_decode = f"http://127.0.0.1:{free_port()}"
    router = start_router("--prefill", p1.url, "--decode", dead_decode, "--health-check-interval-s", "30")
    router.wait_for(lambda: router.workers()[p1.url]["ready"])
    reply = router.get("/health")
    assert reply.status == 503
    assert reply.json()["error"]["message"] == "no decode instance has passed a health check yet"
    assert router.workers()[dead_decode]["ready"] is False
