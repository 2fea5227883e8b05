"""A prefill frozen past the decode's dead-peer timeout, then resumed, writes the KV it had queued: the decode
fences those writes (the request's pages stay quarantined until the prefill confirms), so they never land in
pages given to another request since. Outputs match the colocated server's greedy ones; every pool ends free."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from chaos_util import Stream, pd_body, prompt_ids, send_pair, wait_pool_free
from cluster_util import Proc, decode_server, free_port, prefill_server, server, start_all, stop_all
from pdserve.scheduler.process import STEP_DELAY_ENV

LONG_PROMPT, LONG_OUTPUT = 256, 160
SLOW_DECODE_STEPS = {STEP_DELAY_ENV: "0.03"}  # the victim decodes for seconds: the late write lands meanwhile
END_SECONDS = 60.0


@pytest.fixture
def frozen_pair(tiny_model) -> Iterator[tuple[Proc, int, Proc, Proc]]:
    bootstrap = free_port()
    prefill = prefill_server(tiny_model, "tcp", bootstrap)
    decode = decode_server(tiny_model, "tcp")
    decode.env = {**decode.env, **SLOW_DECODE_STEPS}
    colocated = server("colocated", tiny_model)
    procs = start_all([prefill, decode, colocated])
    yield prefill, bootstrap, decode, colocated
    prefill.signal(signal.SIGCONT)
    stop_all(procs)


def greedy_body(ids: list[int], max_new_tokens: int) -> dict:
    return {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                  "ignore_eos": True}}


def colocated_output(colocated: Proc, ids: list[int], max_new_tokens: int) -> list[int]:
    reply = colocated.post("/generate", greedy_body(ids, max_new_tokens))
    assert reply.status == 200, reply.body
    return reply.json()["output_ids"]


def test_writes_of_a_resumed_prefill_never_reach_reused_pages(frozen_pair):
    prefill, bootstrap, decode, colocated = frozen_pair
    for future in send_pair(prefill, decode, pd_body(prompt_ids(8, 1), bootstrap, room=1)):
        assert future.result()[0].status == 200  # the decode now holds the prefill's route: no lookup below
    prefill.signal(signal.SIGSTOP)
    frozen_prefill_half, decode_half = send_pair(prefill, decode, pd_body(prompt_ids(LONG_PROMPT, 2), bootstrap,
                                                                          room=2), timeout=END_SECONDS)
    assert decode_half.result()[0].status == 502  # the heartbeat declared the prefill dead
    victim_ids = prompt_ids(LONG_PROMPT, 3)
    victim = Stream(decode.url, greedy_body(victim_ids, LONG_OUTPUT), END_SECONDS)  # prefilled on the decode
    assert victim.first_event.wait(30) and not victim.failed(), victim.events[:1]
    prefill.signal(signal.SIGCONT)
    frozen_prefill_half.result()  # the resumed prefill has run (and written) the request it had queued
    victim.future.result()
    assert not victim.failed(), (victim.status, victim.broken, victim.events[-1:])
    assert victim.events[-1]["output_ids"] == colocated_output(colocated, victim_ids, LONG_OUTPUT)
    later_ids = prompt_ids(LONG_PROMPT, 4)
    prefill_half, decode_half = send_pair(prefill, decode, pd_body(later_ids, bootstrap, room=4, max_new_tokens=16))
    assert prefill_half.result()[0].status == 200
    later = decode_half.result()[0]
    assert later.status == 200 and later.json()["output_ids"] == colocated_output(colocated, later_ids, 16)
    for proc in (prefill, decode):
        wait_pool_free(proc, END_SECONDS)
