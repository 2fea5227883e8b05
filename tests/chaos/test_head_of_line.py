"""A decode server that stops answering never delays the prefill's transfers to a healthy one."""

from __future__ import annotations

import signal
import time

import pytest
from chaos_util import holds_pages, pd_body, prompt_ids, send_pair, wait_pool_free, wait_until
from cluster_util import decode_server, free_port, prefill_server, start_all, stop_all

WRITE_TIMEOUT = ["--disaggregation-waiting-timeout", "30"]  # far longer than a healthy request may take
SLOW_HEARTBEAT = ["--disaggregation-heartbeat-interval", "2", "--disaggregation-heartbeat-failures", "5"]
HEALTHY_REQUEST_SECONDS = 10.0


@pytest.fixture
def prefill_and_two_decodes(tiny_model):
    bootstrap = free_port()
    prefill = prefill_server(tiny_model, "tcp", bootstrap, *WRITE_TIMEOUT)
    frozen = decode_server(tiny_model, "tcp", *WRITE_TIMEOUT, *SLOW_HEARTBEAT, name="decode-frozen")
    healthy = decode_server(tiny_model, "tcp", *WRITE_TIMEOUT, name="decode-healthy")
    procs = start_all([prefill, frozen, healthy])
    yield prefill, bootstrap, frozen, healthy
    for proc in procs:
        proc.signal(signal.SIGCONT)
    stop_all(procs)


def test_frozen_decode_does_not_block_transfers_to_a_healthy_one(prefill_and_two_decodes):
    prefill, bootstrap, frozen, healthy = prefill_and_two_decodes
    for decode, room in ((frozen, 1), (healthy, 2)):  # each decode caches the prefill's route
        for future in send_pair(prefill, decode, pd_body(prompt_ids(8, room), bootstrap, room)):
            assert future.result()[0].status == 200
    # The frozen decode's pages are allocated and its transfer_request queued while the prefill is stopped;
    # the prefill then writes into a decode that no longer answers.
    prefill.signal(signal.SIGSTOP)
    stuck = send_pair(prefill, frozen, pd_body(prompt_ids(64, 3), bootstrap, room=3))
    wait_until(lambda: holds_pages(frozen), 10, "the frozen decode pre-allocates its pages")
    frozen.signal(signal.SIGSTOP)
    prefill.signal(signal.SIGCONT)
    time.sleep(0.5)  # the prefill's writer is now waiting on the frozen decode
    prefill_half, decode_half = send_pair(prefill, healthy, pd_body(prompt_ids(64, 4), bootstrap, room=4))
    reply, seconds = decode_half.result()
    assert reply.status == 200 and seconds < HEALTHY_REQUEST_SECONDS, (reply.status, seconds, reply.body[:300])
    assert prefill_half.result()[0].status == 200
    frozen.signal(signal.SIGCONT)
    for future in stuck:
        future.result()  # success or error: the request ends once the decode answers again
    for proc in (prefill, frozen, healthy):
        wait_pool_free(proc, 40)
