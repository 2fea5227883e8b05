"""Hostile connections: a client that sends its headers and then stalls, one that disconnects mid-body, one that
disconnects mid-stream. Other clients are served meanwhile, nothing stays in flight, and no KV page leaks."""

from __future__ import annotations

import json

import pytest
from fuzz_util import assert_serves_correctly, generate_greedy, raw_connection, wait_until_idle

TARGETS = ("colocated", "prefill", "decode", "router")


def request_head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: fuzz\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


@pytest.mark.parametrize("target", TARGETS)
def test_stalled_and_vanished_clients_do_not_block_others(targets, target):
    proc = targets.by_name(target)
    stalled = [raw_connection(proc.url) for _ in range(8)]
    for index, conn in enumerate(stalled):
        conn.sendall(request_head("/generate", 1000) + b'{"text": "stalled' if index % 2 else b"POST /gener")
    vanished = raw_connection(proc.url)
    vanished.sendall(request_head("/v1/completions", 1000) + b'{"prompt": "gone')
    vanished.close()
    try:
        assert proc.get("/health", timeout=5).status == 200
        served = targets.colocated if target in ("prefill", "decode") else proc  # PD halves serve only paired work
        assert generate_greedy(served)["text"] == targets.reference_text
    finally:
        for conn in stalled:
            conn.close()
    for server in targets.servers:
        wait_until_idle(server)


@pytest.mark.parametrize("target", ("colocated", "router"))
def test_disconnect_mid_stream_aborts_the_request(targets, target):
    proc = targets.by_name(target)
    body = json.dumps({"text": "stream until the client leaves", "stream": True,
                       "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}).encode()
    conn = raw_connection(proc.url, timeout=30)
    conn.sendall(request_head("/generate", len(body)) + body)
    received = b""
    while b"data: {" not in received:
        chunk = conn.recv(4096)
        assert chunk, received
        received += chunk
    conn.close()
    assert b" 200 " in received.split(b"\r\n", 1)[0], received[:200]
    for server in targets.servers:
        wait_until_idle(server)
    assert_serves_correctly(targets)
