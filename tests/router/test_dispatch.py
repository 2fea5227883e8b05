"""PD dispatch through a real router process: injected fields, streaming, logprob merge, routes, regular mode."""

from __future__ import annotations

import time

from cluster_util import http, send_stalled_body
from prometheus_client.parser import text_string_to_metric_families

from pdserve_router.metrics import LATENCY_BUCKETS


def pd_router(start_router, prefills, decodes, *extra: str):
    return start_router("--prefill", *[p.url for p in prefills], "--decode", *[d.url for d in decodes], *extra)


def test_both_halves_get_the_same_body_with_bootstrap_fields(stubs, start_router):
    p1, p2, d1 = stubs.add("prefill"), stubs.add("prefill"), stubs.add("decode")
    router = pd_router(start_router, [p1, p2], [d1], "--prefill-bootstrap-ports", "9101", "9102",
                       "--prefill-policy", "round_robin")
    seen_ports = set()
    for i in range(2):
        reply = router.post("/generate", {"text": f"hello {i}", "sampling_params": {"max_new_tokens": 4}},
                            headers={"X-Request-Id": f"client-{i}"})
        assert reply.status == 200 and reply.json()["text"] == "t0 t1 t2 t3 "
        assert reply.headers["X-Request-Id"] == f"client-{i}"
        decode_req = d1.requests[-1]
        prefill_req = (p1.requests + p2.requests)[-1]
        assert prefill_req["body"] == decode_req["body"]
        body = decode_req["body"]
        assert body["bootstrap_host"] == "127.0.0.1" and body["rid"] == f"client-{i}"
        assert 0 <= body["bootstrap_room"] < 2**63
        assert decode_req["headers"]["x-request-id"] == prefill_req["headers"]["x-request-id"] == f"client-{i}"
        seen_ports.add(body["bootstrap_port"])
    assert seen_ports == {9101, 9102}


def test_batched_generate_gets_one_room_and_rid_per_item(stubs, start_router):
    p1, d1 = stubs.add("prefill"), stubs.add("decode")
    router = pd_router(start_router, [p1], [d1])
    reply = router.post("/generate", {"text": ["a", "b", "c"]}, headers={"X-Request-Id": "batch"})
    assert reply.status == 200 and [item["index"] for item in reply.json()] == [0, 1, 2]
    body = d1.requests[-1]["body"]
    assert body["bootstrap_host"] == ["127.0.0.1"] * 3 and body["bootstrap_port"] == [8998] * 3
    assert len(set(body["bootstrap_room"])) == 3
    assert body["rid"] == ["batch-0", "batch-1", "batch-2"]


def test_openai_routes_stream_and_n_gets_a_room_list(stubs, start_router):
    p1, d1 = stubs.add("prefill"), stubs.add("decode")
    router = pd_router(start_router, [p1], [d1])
    chat = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "n": 2}
    reply = router.post("/v1/chat/completions", chat)
    assert reply.status == 200 and reply.json()["choices"][0]["message"]["content"] == "t0 t1 t2 t3 "
    body = d1.requests[-1]["body"]
    assert isinstance(body["bootstrap_host"], str) and len(body["bootstrap_room"]) == 2 and "rid" not in body
    reply = router.post("/v1/completions", {"prompt": "hi", "stream": True})
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/event-stream")
    assert "".join(e["choices"][0]["text"] for e in reply.events()) == "t0 t1 t2 t3 "
    assert reply.body.endswith(b"data: [DONE]\n\n")
    assert isinstance(d1.requests[-1]["body"]["bootstrap_room"], int)


def test_stream_does_not_wait_for_the_prefill_response(stubs, start_router):
    p1, d1 = stubs.add("prefill", response_delay_s=20.0), stubs.add("decode")
    router = pd_router(start_router, [p1], [d1])
    started = time.monotonic()
    reply = router.post("/generate", {"text": "hi", "stream": True})
    assert reply.status == 200 and len(reply.events()) == 4
    assert time.monotonic() - started < 10.0


def test_input_logprobs_of_the_prefill_are_merged(stubs, start_router):
    p1, d1 = stubs.add("prefill"), stubs.add("decode")
    router = pd_router(start_router, [p1], [d1])
    expected = [[-0.5, t, None] for t in range(3)]
    reply = router.post("/generate", {"text": "hi", "return_logprob": True})
    assert reply.json()["meta_info"]["input_token_logprobs"] == expected
    reply = router.post("/generate", {"text": ["a", "b"], "return_logprob": True})
    assert [item["meta_info"]["input_token_logprobs"] for item in reply.json()] == [expected, expected]
    events = router.post("/generate", {"text": "hi", "return_logprob": True, "stream": True}).events()
    assert events[0]["meta_info"]["input_token_logprobs"] == expected
    assert all(e["meta_info"]["input_token_logprobs"] == [] for e in events[1:])
    plain = router.post("/generate", {"text": "hi"}).json()
    assert "input_token_logprobs" not in plain["meta_info"]


def test_admin_routes(stubs, start_router):
    p1, d1, d2 = stubs.add("prefill"), stubs.add("decode"), stubs.add("decode")
    router = pd_router(start_router, [p1], [d1, d2])
    assert router.get("/health").status == 200
    assert router.get("/health_generate").status == 200
    info = router.get("/get_server_info").json()
    assert set(info["instances"]) == {p1.url, d1.url, d2.url}
    assert info["instances"][d2.url]["body"]["name"] == d2.name
    assert {s["name"] for s in info["internal_states"]} == {d1.name, d2.name}
    assert router.get("/v1/models").json()["data"][0]["id"] == "stub-model"
    assert router.get("/get_model_info").json()["served_by"] == p1.name
    assert router.post("/flush_cache").status == 200
    router.post("/generate", {"text": "hi"})
    metrics = router.get("/metrics").body.decode()
    for name in ("requests_total", "errors_total", "retries_total", "in_flight", "added_latency_seconds_bucket"):
        assert f"pdserve_router_{name}" in metrics
    assert router.metric('pdserve_router_requests_total{route="/generate"}') == 1


def test_metrics_parse_with_the_prometheus_parser(stubs, start_router):
    p1, d1 = stubs.add("prefill"), stubs.add("decode")
    router = pd_router(start_router, [p1], [d1])
    router.post("/generate", {"text": "hi"})
    router.post("/generate", b"{not json")
    reply = router.get("/metrics")
    assert reply.headers["Content-Type"].startswith("text/plain")
    families = {family.name: family for family in text_string_to_metric_families(reply.body.decode())}
    errors = families["pdserve_router_errors"]
    assert errors.type == "counter"
    assert [(s.labels, s.value) for s in errors.samples] == [({"kind": "bad_request"}, 1.0)]
    healthy = families["pdserve_router_worker_healthy"]
    assert healthy.type == "gauge"
    assert {(s.labels["url"], s.labels["role"], s.value) for s in healthy.samples} == {
        (p1.url, "prefill", 1.0), (d1.url, "decode", 1.0)}
    added = families["pdserve_router_added_latency_seconds"]
    edges = [float(s.labels["le"]) for s in added.samples if s.name.endswith("_bucket")]
    assert edges == [*LATENCY_BUCKETS, float("inf")]
    assert next(s.value for s in added.samples if s.name.endswith("_count")) == 1


def test_router_errors_keep_the_error_shape(stubs, start_router):
    p1, d1 = stubs.add("prefill"), stubs.add("decode")
    router = pd_router(start_router, [p1], [d1], "--api-key", "k")
    key = {"Authorization": "Bearer k"}
    replies = {
        "invalid_request_error": [router.post("/generate", b"{not json", headers=key),
                                  http("GET", router.url + "/generate", headers=key),
                                  router.post("/generate", {"text": "x", "rid": "r" * 10**6}, headers=key)],
        "not_found_error": [router.post("/v2/everything", {}, headers=key)],
        "authentication_error": [router.post("/generate", {"text": "x"})],
    }
    assert [r.status for r in replies["invalid_request_error"]] == [400, 405, 400]
    for error_type, of_type in replies.items():
        for reply in of_type:
            assert reply.json()["error"]["type"] == error_type and reply.json()["error"]["code"] == reply.status
    assert "malformed JSON" in replies["invalid_request_error"][0].json()["error"]["message"]
    assert router.post("/generate", {"text": "x", "rid": 5}, headers=key).status == 400
    assert router.post("/v1/chat/completions", {"messages": [], "n": 10**9}, headers=key).status == 400


def test_upstream_4xx_is_passed_through_without_retry(stubs, start_router):
    p1, d1 = stubs.add("prefill"), stubs.add("decode", fail_status=400)
    router = pd_router(start_router, [p1], [d1])
    reply = router.post("/generate", {"text": "hi"})
    assert reply.status == 400 and "fails on purpose" in reply.json()["error"]["message"]
    assert len(d1.requests) == 1 and router.metric("pdserve_router_retries_total") == 0


def test_regular_mode_balances_without_bootstrap_fields(stubs, start_router):
    w1, w2 = stubs.add("regular"), stubs.add("regular")
    router = start_router("--worker", w1.url, w2.url, "--policy", "round_robin")
    served = [router.post("/generate", {"text": f"q{i}", "stream": i % 2 == 0}).status for i in range(6)]
    assert served == [200] * 6 and len(w1.requests) == len(w2.requests) == 3
    assert all("bootstrap_room" not in r["body"] for r in w1.requests + w2.requests)


def test_api_key_is_required_and_forwarded(stubs, start_router):
    p1, d1 = stubs.add("prefill"), stubs.add("decode")
    router = pd_router(start_router, [p1], [d1], "--api-key", "sekrit")
    assert router.post("/generate", {"text": "hi"}).status == 401
    assert router.get("/health").status == 200
    reply = router.post("/generate", {"text": "hi"}, headers={"Authorization": "Bearer sekrit"})
    assert reply.status == 200
    assert d1.requests[-1]["headers"]["authorization"] == p1.requests[-1]["headers"]["authorization"] == "Bearer sekrit"



def test_event_loop_flag(stubs, start_router):
    w1 = stubs.add("regular")
    try:
        import uvloop  # noqa: F401
        default = "uvloop"
    except ImportError:
        default = "asyncio"
    assert start_router("--worker", w1.url).get("/workers").json()["event_loop"] == default
    router = start_router("--worker", w1.url, "--event-loop", "asyncio")
    assert router.get("/workers").json()["event_loop"] == "asyncio"
    reply = router.post("/generate", {"text": "hi", "stream": True})
    assert reply.status == 200 and len(reply.events()) == 4


def test_client_fields_and_charsets_reach_the_instances(stubs, start_router):
    p1, d1 = stubs.add("prefill"), stubs.add("decode")
    router = pd_router(start_router, [p1], [d1])
    reply = router.post("/generate", {"text": "héllo", "rid": "mine", "bootstrap_room": 5, "stream": True})
    assert reply.status == 200 and len(reply.events()) == 4
    body = d1.requests[-1]["body"]
    assert body["rid"] == "mine" and body["text"] == "héllo" and body["bootstrap_room"] != 5
    assert p1.requests[-1]["body"] == body
    latin1 = '{"text": "caf\xe9"}'.encode("latin-1")
    reply = router.post("/generate", latin1, headers={"Content-Type": "application/json; charset=latin-1"})
    assert reply.status == 200 and d1.requests[-1]["body"]["text"] == "café"
    assert router.post("/generate", "{\"text\": \"x\"}".encode("utf-16")).status == 200
    assert d1.requests[-1]["body"]["text"] == "x"


def test_a_stalled_body_is_cut_with_408(stubs, start_router):
    router = start_router("--worker", stubs.add("regular").url, "--request-body-timeout-s", "1")
    reply, seconds = send_stalled_body(router.url)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b'"type": "invalid_request_error"' in reply and 0.5 < seconds < 5
