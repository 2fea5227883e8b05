"""Adding and removing instances at run time through /workers."""

from __future__ import annotations


def test_added_workers_receive_traffic_and_removed_ones_stop(stubs, start_router):
    p1, d1 = stubs.add("prefill"), stubs.add("decode")
    router = start_router("--prefill", p1.url, "--decode", d1.url, "--decode-policy", "round_robin",
                          "--prefill-policy", "round_robin")
    p2, d2 = stubs.add("prefill"), stubs.add("decode")
    reply = router.post("/workers", {"url": p2.url, "role": "prefill", "bootstrap_port": 9200})
    assert reply.status == 201 and reply.json()["healthy"] is True
    assert router.post("/workers", {"url": d2.url + "/", "role": "decode"}).status == 201
    assert set(router.workers()) == {p1.url, p2.url, d1.url, d2.url}
    for i in range(4):
        assert router.post("/generate", {"text": f"q{i}"}).status == 200
    assert len(d2.requests) == 2 and len(p2.requests) == 2
    assert {r["body"]["bootstrap_port"] for r in p2.requests} == {9200}
    assert router.delete("/workers", {"url": d1.url}).status == 200
    assert router.delete(f"/workers?url={p1.url}").status == 200
    for i in range(3):
        assert router.post("/generate", {"text": f"r{i}"}).status == 200
    assert len(d2.requests) == 5 and len(p2.requests) == 5 and len(d1.requests) == 2


def test_workers_api_rejects_bad_input(stubs, start_router):
    d1 = stubs.add("decode")
    router = start_router("--decode", d1.url)
    assert router.post("/workers", {"url": d1.url, "role": "decode"}).status == 409
    assert router.post("/workers", {"url": "http://127.0.0.1:1", "role": "regular"}).status == 400
    assert router.post("/workers", {"url": "ftp://x", "role": "decode"}).status == 400
    assert router.post("/workers", {"url": "http://127.0.0.1:1", "role": "prefill", "bootstrap_port": 0}).status == 400
    assert router.delete("/workers", {"url": "http://127.0.0.1:1"}).status == 404
    assert router.delete("/workers").status == 400


def test_pd_router_can_start_empty_and_reports_what_is_missing(stubs, start_router):
    router = start_router()
    reply = router.post("/generate", {"text": "hi"})
    assert reply.status == 503 and "no healthy" in reply.json()["error"]["message"]
    p1, d1 = stubs.add("prefill"), stubs.add("decode")
    router.post("/workers", {"url": p1.url, "role": "prefill"})
    router.post("/workers", {"url": d1.url, "role": "decode"})
    assert router.post("/generate", {"text": "hi"}).status == 200
