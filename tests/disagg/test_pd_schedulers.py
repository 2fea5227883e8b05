"""The prefill and decode schedulers in one process over the tcp backend: handoff, chunking, failures, pools."""

from __future__ import annotations

import random
import threading
import time

import pytest
from cluster_util import free_port

from pdserve.config import ServerArgs
from pdserve.disagg.handoff import KVPoll
from pdserve.messages import FAKE_BOOTSTRAP_HOST
from pdserve.disagg.factory import create_scheduler
from pdserve.disagg.transfer.base import TransferError
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.request import Req
from pdserve.scheduler.scheduler import Scheduler

TIMEOUTS = dict(disaggregation_bootstrap_timeout=10.0, disaggregation_waiting_timeout=10.0)  # room for a loaded CI box


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


def engine_args(model, **kw) -> dict:
    return dict(model_path=model, device="cpu", max_total_tokens=4096, page_size=4, chunked_prefill_size=32,
                disaggregation_transfer_backend="tcp", **TIMEOUTS) | kw


def make_pair(model, **kw) -> tuple[Scheduler, Scheduler, int]:
    port = free_port()  # not a fixed range: other test runs on the machine may hold it
    prefill = create_scheduler(ServerArgs(disaggregation_mode="prefill", disaggregation_bootstrap_port=port,
                                          port=1, **engine_args(model, **kw)))
    decode = create_scheduler(ServerArgs(disaggregation_mode="decode", port=2, **engine_args(model, **kw)))
    return prefill, decode, port


@pytest.fixture(scope="module")
def pair(model):
    prefill, decode, port = make_pair(model)
    yield prefill, decode, port
    prefill.close()
    decode.close()


def run(scheds, timeout=60.0, max_steps: int | None = None) -> dict[tuple[int, str], dict]:
    """Steps every scheduler until all drained (or `max_steps` rounds); their outputs by (scheduler, rid)."""
    outs: dict[tuple[int, str], dict] = {}
    deadline = time.monotonic() + timeout
    rounds = 0
    while any(s.has_work() for s in scheds) and (max_steps is None or rounds < max_steps):
        rounds += 1
        assert time.monotonic() < deadline, "schedulers did not drain"
        for i, s in enumerate(scheds):
            for o in s.step():
                entry = outs.setdefault((i, o.rid), {"ids": [], "finish": None})
                entry["ids"] += o.new_token_ids
                entry["cached_tokens"] = o.cached_tokens
                entry["finish"] = o.finish_reason or entry["finish"]
    return outs


def greedy(n=8):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def pd_req(rid, ids, port, room, n=8):
    return Req(rid=rid, input_ids=list(ids), sampling_params=greedy(n), bootstrap_host="127.0.0.1",
               bootstrap_port=port, bootstrap_room=room)


def colocated_ids(model, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy output (`greedy()`) from a colocated scheduler."""
    colocated = create_scheduler(ServerArgs(**engine_args(model, disaggregation_transfer_backend="auto")))
    for i, p in enumerate(prompts):
        colocated.add_request(Req(rid=str(i), input_ids=list(p), sampling_params=greedy()))
    outs = run([colocated])
    return [outs[(0, str(i))]["ids"] for i in range(len(prompts))]


def send_page_lists(decode: Scheduler, rooms: range, timeout: float = 30.0) -> None:
    """Step the decode alone until every room's page list went out to its prefill (WAITING_FOR_INPUT)."""
    deadline = time.monotonic() + timeout
    while any(decode.role.link.handoffs[room].poll != KVPoll.WAITING_FOR_INPUT for room in rooms):
        assert time.monotonic() < deadline, "the decode did not send its page lists in time"
        decode.step()


def check_pd_equals_colocated(model, pair, lengths: tuple[int, ...], seed: int, first_room: int,
                              page_lists_first: bool = False) -> None:
    """PD's greedy outputs equal colocated's; page_lists_first: the decode's page lists reach the prefill before
    its first step, so every chunk's KV may be pushed as it is computed (else that depends on the race between the
    two schedulers)."""
    prefill, decode, port = pair
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 900) for _ in range(n)] for n in lengths]
    expected = colocated_ids(model, prompts)  # first: the PD handshake deadlines start when the requests are added
    for i, p in enumerate(prompts):
        for s in (prefill, decode):
            s.add_request(pd_req(str(i), p, port, room=first_room + i))
    if page_lists_first:
        send_page_lists(decode, range(first_room, first_room + len(prompts)))
    got = run([prefill, decode])
    for i in range(len(prompts)):
        assert got[(1, str(i))]["ids"] == expected[i]
        assert got[(0, str(i))]["ids"] == expected[i][:1]  # prefill reports the first token
    assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()


def test_pd_output_equals_colocated_including_chunked_prompts(model, pair):
    check_pd_equals_colocated(model, pair, (3, 31, 70, 130), seed=0, first_room=100)  # 70 and 130 are chunked


def test_layerwise_push_matches_colocated(model):
    """Chunks of 8+ tokens ship each layer's KV during the forward; shorter ones after it (page size 4)."""
    prefill, decode, port = make_pair(model, disaggregation_layerwise_min_tokens=8, disaggregation_staging_mb=0)
    span_counts = []  # per write job: 2 (K, V) x page runs x layers; 0 for the final first-token marker
    submit = prefill.role.writers.submit
    prefill.role.writers.submit = lambda job: (span_counts.append(sum(len(p.spans()[2]) for p in job.pieces)),
                                               submit(job))
    try:
        check_pd_equals_colocated(model, (prefill, decode, port), (3, 40, 130), seed=1, first_room=300,
                                  page_lists_first=True)
        num_layers = prefill.model_config.num_layers
        # a job of 2 spans is one page run of one layer (a whole-chunk push has 2 x num_layers per run)
        assert num_layers > 1 and span_counts.count(2) >= 2 * num_layers
    finally:
        prefill.close()
        decode.close()


def test_prefill_refuses_a_request_without_bootstrap_fields_and_decode_half_of_them(pair):
    prefill, decode, _ = pair
    with pytest.raises(ValueError, match="bootstrap_host, bootstrap_port and bootstrap_room"):
        prefill.add_request(Req(rid="x", input_ids=[5, 6, 7], sampling_params=greedy()))
    with pytest.raises(ValueError, match="bootstrap_host, bootstrap_port and bootstrap_room"):
        decode.add_request(Req(rid="x", input_ids=[5, 6, 7], sampling_params=greedy(), bootstrap_host="127.0.0.1"))


def test_decode_prefills_a_request_without_bootstrap_fields_like_colocated(model, pair):
    """Conditional disaggregation: local prompts (one of them in 3 chunks of 32) join a running PD request; each
    local chunk step is followed by a decode step, and every output equals colocated."""
    prefill, decode, port = pair
    rng = random.Random(7)
    prompts = {rid: [rng.randrange(3, 900) for _ in range(n)] for rid, n in
               (("remote", 40), ("local-short", 5), ("local-chunked", 70))}
    colocated = create_scheduler(ServerArgs(**engine_args(model, disaggregation_transfer_backend="auto")))
    for rid, ids in prompts.items():
        colocated.add_request(Req(rid=rid, input_ids=list(ids), sampling_params=greedy(24)))
    expected = run([colocated])
    local_before = decode.role.num_local_prefills
    for s in (prefill, decode):
        s.add_request(pd_req("remote", prompts["remote"], port, room=700, n=24))
    got: dict[tuple[int, str], dict] = {}
    deadline = time.monotonic() + 60
    while not decode.running:  # the remote request is decoding before the local ones arrive
        assert time.monotonic() < deadline, "the PD request never started decoding"
        merge(got, run([prefill, decode], max_steps=1))
    steps = []  # (forward mode, requests decoding at that forward) on the decode server

    def observe(batch) -> None:
        steps.append((batch.mode.name, len(decode.running)))

    decode.runner.forward_observers.append(observe)
    try:
        for rid in ("local-short", "local-chunked"):
            decode.add_request(Req(rid=rid, input_ids=list(prompts[rid]), sampling_params=greedy(24)))
        merge(got, run([prefill, decode]))
    finally:
        decode.runner.forward_observers.remove(observe)
    for rid in prompts:
        assert got[(1, rid)]["ids"] == expected[(0, rid)]["ids"], rid
    assert (0, "local-short") not in got and decode.role.num_local_prefills == local_before + 2
    extends = [i for i, (mode, _) in enumerate(steps) if mode == "EXTEND"]
    assert len(extends) >= 3  # local-chunked: 70 tokens in chunks of 32
    assert all(steps[i - 1][0] != "EXTEND" for i in extends if i > 0 and steps[i][1] > 0), steps
    assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()


def merge(into: dict, outs: dict) -> None:
    for key, entry in outs.items():
        mine = into.setdefault(key, {"ids": [], "finish": None})
        mine["ids"] += entry["ids"]
        mine["finish"] = entry["finish"] or mine["finish"]


def test_fake_transfer_requests_serve_health_checks(pair):
    prefill, decode, _ = pair
    for s in (prefill, decode):
        s.add_request(Req(rid="health", input_ids=[5, 6, 7], sampling_params=greedy(1),
                          bootstrap_host=FAKE_BOOTSTRAP_HOST, bootstrap_room=0))
    outs = run([prefill, decode])
    assert len(outs[(0, "health")]["ids"]) == 1 and len(outs[(1, "health")]["ids"]) == 1
    assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()


def test_decode_abort_reaches_prefill_and_frees_both_pools(pair):
    prefill, decode, port = pair
    prompt = list(range(10, 90))
    for s in (prefill, decode):
        s.add_request(pd_req("gone", prompt, port, room=555, n=40))
    for _ in range(200):  # until the decode side runs the request or is waiting for its KV
        prefill.step()
        decode.step()
        if "gone" in decode.reqs and (decode.reqs["gone"].output_ids or decode.role.link.handoffs):
            break
    decode.abort_request("gone")
    outs = run([prefill, decode])
    assert outs[(1, "gone")]["finish"]["type"] == "abort"
    assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()


def test_unclaimed_room_times_out_on_the_prefill(pair):
    prefill, _, port = pair
    prefill.add_request(pd_req("lonely", [5, 6, 7, 8], port, room=777))
    outs = run([prefill], timeout=30)
    finish = outs[(0, "lonely")]["finish"]
    assert finish["type"] == "abort" and "no decode server claimed bootstrap_room 777" in finish["message"]
    assert prefill.kv_pool_is_fully_free()


def test_page_size_mismatch_is_refused_naming_both_values(model, pair):
    prefill, _, port = pair
    other = create_scheduler(ServerArgs(disaggregation_mode="decode", port=3, **engine_args(model, page_size=8)))
    try:
        for s in (prefill, other):
            s.add_request(pd_req("mismatch", [5, 6, 7, 8, 9], port, room=888))
        outs = run([prefill, other], timeout=5)  # the prefill is told at once, well before its 10 s timeout
        message = outs[(1, "mismatch")]["finish"]["message"]
        assert "page_size mismatch: prefill has 4, decode has 8" in message
        assert prefill.kv_pool_is_fully_free() and other.kv_pool_is_fully_free()
    finally:
        other.close()


def test_write_failing_after_the_handoff_failed_still_frees_the_prefill_pages(model):
    """The decode dies mid-transfer: the request is aborted while a write is in flight, then that write fails."""
    prefill, decode, port = make_pair(model)
    write_started, write_may_fail = threading.Event(), threading.Event()

    def dying_peer_write(*_args) -> None:
        write_started.set()
        write_may_fail.wait(10)
        raise TransferError("the decode peer vanished")

    prefill.role.link.engine.write = dying_peer_write
    try:
        for s in (prefill, decode):
            s.add_request(pd_req("victim", list(range(10, 30)), port, room=999, n=8))  # one chunk, one write
        deadline = time.monotonic() + 30
        while not write_started.is_set():
            assert time.monotonic() < deadline, "no KV write started"
            prefill.step()
            decode.step()
        prefill.abort_request("victim")
        write_may_fail.set()
        while not prefill.kv_pool_is_fully_free():
            assert time.monotonic() < deadline, "the prefill kept the pages of the failed handoff"
            prefill.step()
        assert not prefill.role.link.handoffs
    finally:
        write_may_fail.set()
        prefill.close()
        decode.close()
