"""PD failure handling with real processes: incompatible decode servers are refused with a message naming both
values, a request no decode claims times out on the prefill, and a decode server killed mid-stream gives the
client an error while the prefill's pages come back. The session's tcp prefill serves every case here."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from cluster_util import PDCluster, Proc, decode_server, http, router, start_all, stop_all, wait_kv_free

pytestmark = pytest.mark.timeout(900)  # the first test also pays for starting the servers

PROMPT = "The capital of France is"
FAIL_WITHIN_S = 15.0  # the PD timeouts in cluster_util are 6 s


@pytest.fixture(scope="module")
def extra_decodes(tiny_model, other_model, tcp_cluster: PDCluster) -> Iterator[dict[str, Proc]]:
    decodes = {
        "page8": decode_server(tiny_model, "tcp", "--page-size", "8", name="decode-page8"),
        "llama": decode_server(other_model, "tcp", name="decode-llama"),
        "victim": decode_server(tiny_model, "tcp", name="decode-victim"),
    }
    start_all(list(decodes.values()))
    yield decodes
    stop_all(decodes.values())


@pytest.fixture(scope="module")
def failure_router(tcp_cluster: PDCluster, extra_decodes) -> Iterator[Proc]:
    """A router over the tcp prefill; each test makes the decode server it needs the only one."""
    proc = router([(tcp_cluster.prefill, tcp_cluster.bootstrap_port)], [extra_decodes["victim"]], "--max-retries", "0",
                  "--request-timeout-s", "60", name="router-failures")
    start_all([proc])
    yield proc
    stop_all([proc])


def use_decode(router_proc: Proc, decode: Proc) -> None:
    """Make `decode` the router's only decode server."""
    for worker in router_proc.get("/workers").json()["workers"]:
        if worker["role"] == "decode":
            assert http("DELETE", f"{router_proc.url}/workers?url={worker['url']}").status == 200
    reply = router_proc.post("/workers", {"url": decode.url, "role": "decode"})
    assert reply.status == 201 and reply.json()["healthy"], reply.body


@pytest.mark.parametrize("decode_name, expected", [
    ("page8", "page_size mismatch: prefill has 16, decode has 8"),
    ("llama", "model mismatch: prefill has 'Qwen3ForCausalLM"),
])
def test_incompatible_decode_is_refused(tcp_cluster, extra_decodes, failure_router, decode_name, expected):
    decode = extra_decodes[decode_name]
    use_decode(failure_router, decode)
    started = time.monotonic()
    reply = failure_router.post("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 8}},
                                timeout=FAIL_WITHIN_S)
    assert time.monotonic() - started < FAIL_WITHIN_S
    assert reply.status == 502, reply.body  # the decode's 502, passed on after the router's one attempt
    message = reply.json()["error"]["message"]
    assert expected in message, message
    if decode_name == "llama":
        assert "decode has 'LlamaForCausalLM" in message
    assert expected in decode.log()
    wait_kv_free([decode, tcp_cluster.prefill])  # the prefill frees the unclaimed room at its bootstrap timeout


@pytest.mark.parametrize("stream", [False, True])
def test_unclaimed_room_times_out_on_prefill(tcp_cluster, stream):
    """A request the router sent to the prefill but that no decode server ever claims: a 504 before any byte,
    streamed or not, so a router can retry it on another pair."""
    timeouts_before = bootstrap_timeouts(tcp_cluster.prefill)
    started = time.monotonic()
    reply = tcp_cluster.prefill.post("/generate", {
        "text": PROMPT, "sampling_params": {"max_new_tokens": 8}, "bootstrap_host": "127.0.0.1", "stream": stream,
        "bootstrap_port": tcp_cluster.bootstrap_port, "bootstrap_room": 4242 + stream}, timeout=FAIL_WITHIN_S)
    assert time.monotonic() - started < FAIL_WITHIN_S
    assert reply.status == 504, reply.body
    assert f"no decode server claimed bootstrap_room {4242 + stream}" in reply.json()["error"]["message"]
    assert bootstrap_timeouts(tcp_cluster.prefill) == timeouts_before + 1
    wait_kv_free([tcp_cluster.prefill])


def bootstrap_timeouts(prefill: Proc) -> float:
    """The prefill's `pdserve_kv_transfer_failures_total{reason="bootstrap_timeout"}`."""
    series = 'pdserve_kv_transfer_failures_total{reason="bootstrap_timeout",role="prefill"} '
    lines = [line for line in prefill.get("/metrics").body.decode().splitlines() if line.startswith(series)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_decode_killed_mid_stream(tcp_cluster, extra_decodes, failure_router):
    victim = extra_decodes["victim"]
    use_decode(failure_router, victim)
    body = {"text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    req = urllib.request.Request(failure_router.url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    events: list[dict] = []
    first_tokens = threading.Event()
    with urllib.request.urlopen(req, timeout=FAIL_WITHIN_S) as resp:
        def read_stream() -> None:
            for line in resp:
                if line.startswith(b"data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events) >= 3:
                        first_tokens.set()
            first_tokens.set()

        reader = threading.Thread(target=read_stream, daemon=True)
        reader.start()
        assert first_tokens.wait(60), "the stream never started"
        victim.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        reader.join(FAIL_WITHIN_S)
        assert not reader.is_alive(), "the client still waits after the decode server died"
    assert time.monotonic() - killed_at < FAIL_WITHIN_S
    assert "error" in events[-1], events[-1]
    assert victim.url in events[-1]["error"]["message"]
    assert events[-1]["error"]["code"] == 502
    assert len(events[-2]["output_ids"]) < 400
    wait_kv_free([tcp_cluster.prefill])
