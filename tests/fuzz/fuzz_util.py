"""What the fuzz tests share: the processes under test, raw HTTP with a client timeout on every request, the
verdict on an answer (a JSON 4xx, a success, or a deliberate 502/503/504) and the health check afterwards."""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from cluster_util import Proc, wait_kv_free

CLIENT_TIMEOUT_S = 60.0  # every fuzz request has one: a request that outlives it is a hang
DELIBERATE_5XX = (502, 503, 504)  # a peer or upstream failed or timed out, or no instance is ready
GENERATION_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
NORMAL_PROMPT = "The quick brown fox"


@dataclass(frozen=True, slots=True)
class Targets:
    colocated: Proc
    prefill: Proc
    decode: Proc
    router: Proc
    reference_text: str  # greedy output of the normal request, taken before any abuse

    def by_name(self, name: str) -> Proc:
        return getattr(self, name)

    @property
    def servers(self) -> list[Proc]:
        return [self.colocated, self.prefill, self.decode]


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    content_type: str


def send(url: str, method: str, path: str, body: bytes | None = None,
         content_type: str | None = "application/json", timeout: float = CLIENT_TIMEOUT_S) -> Answer:
    """One request over a fresh connection; the body bytes go exactly as given (no client-side JSON encoding)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        headers = {"Content-Type": content_type} if content_type else {}
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return Answer(response.status, response.read(), response.getheader("Content-Type", ""))
    finally:
        conn.close()


def problem(answer: Answer) -> str | None:
    """What is wrong with an answer to a hostile request, or None: a status of 500 or more that is not a
    deliberate 502/503/504, or an error that is not a JSON object with an `error`."""
    if answer.status >= 500 and answer.status not in DELIBERATE_5XX:
        return f"HTTP {answer.status}: {answer.body[:300]!r}"
    if answer.status >= 400:
        try:
            error = json.loads(answer.body)
        except ValueError:
            return f"HTTP {answer.status} with a body that is not JSON: {answer.body[:300]!r}"
        if not isinstance(error, dict) or "error" not in error:
            return f"HTTP {answer.status} without an error object: {answer.body[:300]!r}"
    return None


def generate_greedy(proc: Proc, max_new_tokens: int = 8) -> dict:
    body = {"text": NORMAL_PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    reply = proc.post("/generate", body, timeout=CLIENT_TIMEOUT_S)
    assert reply.status == 200, reply.body
    return reply.json()


def assert_serves_correctly(targets: Targets) -> None:
    """After the abuse: every process is alive, greedy output through the colocated server and through the PD pair
    is the reference, and every KV pool is fully free once the prefix caches are flushed."""
    expected_text = targets.reference_text
    for proc in [*targets.servers, targets.router]:
        proc.check_alive()
    assert generate_greedy(targets.colocated)["text"] == expected_text
    assert generate_greedy(targets.router)["text"] == expected_text
    for proc in targets.servers:
        wait_until_idle(proc)
        assert proc.post("/flush_cache", b"").status == 200
    wait_kv_free(targets.servers)


def wait_until_idle(proc: Proc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (in_flight := proc.get("/get_server_info").json()["requests_in_flight"]) != 0:
        assert time.monotonic() < deadline, f"{proc.name} still has {in_flight} requests in flight"
        time.sleep(0.1)


def raw_connection(url: str, timeout: float = CLIENT_TIMEOUT_S) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout)
