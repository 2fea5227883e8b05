"""Huge ids are refused at once with a 400 on every route (server and router), and a body slower than
--request-body-timeout-s is cut with a 408."""

from __future__ import annotations

import time

import cluster_util
import pytest
from pdserve_router.payload import BadRequest, check_short_fields

HUGE = "r" * 1_000_000


@pytest.mark.parametrize("path, body", [
    ("/generate", {"text": "hi", "rid": HUGE}),
    ("/generate", {"text": ["a", "b"], "rid": ["x", HUGE]}),
    ("/v1/completions", {"model": "m", "prompt": "hi", "rid": HUGE}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "rid": HUGE}),
    ("/v1/completions", {"model": HUGE, "prompt": "hi"}),
    ("/abort_request", {"rid": HUGE}),
])
def test_a_huge_id_is_a_fast_400_on_the_server(server, path, body):
    started = time.monotonic()
    reply = server.post(path, body)
    assert reply.status == 400 and "at most 512 characters" in reply.json()["error"]["message"], reply.body[:300]
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("request_id, body", [
    ("a", {"rid": HUGE}), ("a", {"rid": ["x", HUGE]}), ("a", {"model": HUGE}), ("a", {"user": HUGE}), (HUGE, {}),
])
def test_the_router_refuses_huge_ids(request_id, body):
    with pytest.raises(BadRequest, match="longer than 512 characters"):
        check_short_fields(request_id, body)


def test_a_stalled_body_is_cut_with_408(tiny_model, tmp_path):
    server = cluster_util.server("slow-body", tiny_model, "--request-body-timeout-s", "1",
                                 log_path=str(tmp_path / "server.log"))
    cluster_util.start_all([server])
    try:
        reply, seconds = cluster_util.send_stalled_body(server.url)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert 0.5 < seconds < 5
    finally:
        server.stop()
