"""The prefill computes while its decode allocates: a request is queued as soon as it arrives, only its KV writes
wait for the decode's page list, and computing ahead of page lists is bounded by a share of the pool.

In-process schedulers over the tcp backend; the decode's page list is held back simply by not stepping (or not yet
giving the request to) the decode scheduler."""

from __future__ import annotations

import math
import random
import time

from test_pd_schedulers import engine_args, greedy, make_pair, pd_req, run

from pdserve.config import ServerArgs
from pdserve.disagg.factory import create_scheduler
from pdserve.disagg.handoff import KVPoll
from pdserve.scheduler.request import Req
from pdserve import timeline as tl


def colocated_outputs(model: str, prompts: dict[str, list[int]], n: int) -> dict[str, list[int]]:
    colocated = create_scheduler(ServerArgs(**engine_args(model, disaggregation_transfer_backend="auto")))
    try:
        for rid, ids in prompts.items():
            colocated.add_request(Req(rid=rid, input_ids=list(ids), sampling_params=greedy(n)))
        return {rid: out["ids"] for (_, rid), out in run([colocated]).items()}
    finally:
        colocated.close()


def step_until(sched, done, what: str, timeout: float = 30.0) -> list:
    """Steps `sched` until `done()`; the outputs it reported meanwhile."""
    deadline = time.monotonic() + timeout
    outputs = []
    while not done():
        assert time.monotonic() < deadline, what
        outputs += sched.step()
    return outputs


def test_the_prefill_computes_before_the_page_list_and_the_output_equals_colocated(tiny_model):
    """Chunked (70 tokens, chunks of 32) and single-chunk prompts are fully prefilled while their decode has not
    even received them; their first tokens are reported, and their KV goes out, once the page list comes; the
    decode's tokens are colocated's."""
    rng = random.Random(3)
    prompts = {"chunked": [rng.randrange(3, 900) for _ in range(70)], "short": [rng.randrange(3, 900) for _ in range(9)]}
    expected = colocated_outputs(tiny_model, prompts, n=8)
    prefill, decode, port = make_pair(tiny_model, disaggregation_layerwise_min_tokens=8)
    try:
        rooms = {rid: 4100 + i for i, rid in enumerate(prompts)}
        for rid, ids in prompts.items():
            prefill.add_request(pd_req(rid, ids, port, rooms[rid]))
        handoffs = prefill.role.link.handoffs
        early = step_until(prefill, lambda: all(h.prefilled for h in handoffs.values()), "the prefill waited")
        assert not any(out.new_token_ids for out in early)  # held back: no decode has claimed them yet
        for rid, room in rooms.items():
            h = handoffs[room]
            assert h.poll == KVPoll.BOOTSTRAPPING and h.pages_sent == 0 and h.writes_in_flight == 0
            assert h.req.output_ids == expected[rid][:1]  # the first token, sampled without any page list
            marks = h.req.stage_marks.marked
            assert tl.FIRST_TOKEN_SAMPLED in marks and tl.DECODE_PAGES_KNOWN not in marks
        for rid, ids in prompts.items():
            decode.add_request(pd_req(rid, ids, port, rooms[rid]))
        got = run([prefill, decode])
        for rid in prompts:
            assert got[(1, rid)]["ids"] == expected[rid], rid
            assert got[(0, rid)]["ids"] == expected[rid][:1], rid  # the prefill's answer: its first token
        assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()
    finally:
        prefill.close()
        decode.close()


def test_a_page_list_arriving_mid_prompt_ships_the_computed_chunks_then_the_rest(tiny_model):
    """The first chunk computes without pages; the page list comes before the second: the first chunk's pages go
    out at once, the later ones as they are computed."""
    prompt = list(range(20, 120))  # 100 tokens: chunks of 32
    expected = colocated_outputs(tiny_model, {"mid": prompt}, n=6)
    prefill, decode, port = make_pair(tiny_model)
    try:
        prefill.add_request(pd_req("mid", prompt, port, room=4200, n=6))
        h = prefill.role.link.handoffs[4200]
        step_until(prefill, lambda: h.pages_computed > 0, "no chunk computed")
        assert h.pages_sent == 0 and not h.prefilled
        decode.add_request(pd_req("mid", prompt, port, room=4200, n=6))
        got = run([prefill, decode])
        assert got[(1, "mid")]["ids"] == expected["mid"]
        assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()
    finally:
        prefill.close()
        decode.close()


def test_computing_ahead_of_page_lists_is_bounded_by_a_share_of_the_pool(tiny_model):
    """With no decode claiming, the prefill queues requests only while their prompts fit in
    --disaggregation-prefill-ahead-share (0.5) of its pool; the rest wait, counted as queued prefill tokens, and go
    as soon as their page lists come."""
    prefill, decode, port = make_pair(tiny_model, max_total_tokens=1024, disaggregation_bootstrap_timeout=120.0)
    try:
        page_size, pages = prefill.page_size, prefill.allocator.capacity
        budget = int(prefill.runner.pool.layout.num_pages * prefill.args.disaggregation_prefill_ahead_share)
        prompt_len = 96  # 24 pages of 4 tokens each
        count = math.ceil(budget / (prompt_len / page_size)) + 3
        rng = random.Random(5)
        prompts = {f"r{i}": [rng.randrange(3, 900) for _ in range(prompt_len)] for i in range(count)}
        for i, (rid, ids) in enumerate(prompts.items()):
            prefill.add_request(pd_req(rid, ids, port, room=4300 + i, n=2))
        role = prefill.role
        prefill.step()
        queued = [h for h in role.link.handoffs.values() if h.room not in role.held_back]
        step_until(prefill, lambda: all(h.prefilled for h in queued), "the queued requests were not computed")
        for _ in range(3):  # nothing more is queued while no page list comes
            prefill.step()
        assert role.held_back and queued == [h for h in role.link.handoffs.values() if h.room not in role.held_back]
        assert sum(math.ceil(len(h.req.input_ids) / page_size) for h in queued) <= budget < pages
        assert all(h.prefilled for h in queued) and not any(h.req.stage_marks.marked & {tl.QUEUED}
                                                            for h in role.held_back.handoffs())
        assert prefill.queued_prefill_tokens() == prompt_len * len(role.held_back)
        for i, (rid, ids) in enumerate(prompts.items()):
            decode.add_request(pd_req(rid, ids, port, room=4300 + i, n=2))
        got = run([prefill, decode])
        assert all(len(got[(1, rid)]["ids"]) == 2 for rid in prompts)
        assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()
    finally:
        prefill.close()
        decode.close()


def test_a_refused_page_list_fails_a_prefilled_request_and_frees_its_pages(tiny_model):
    """The request was computed before its decode answered; the decode's answer is refused (another page size):
    the request ends with the reason, and every page comes back."""
    prefill, _, port = make_pair(tiny_model)
    other = create_scheduler(ServerArgs(disaggregation_mode="decode", port=3, **engine_args(tiny_model, page_size=8)))
    try:
        prompt = list(range(30, 75))
        prefill.add_request(pd_req("refused", prompt, port, room=4400))
        h = prefill.role.link.handoffs[4400]
        step_until(prefill, lambda: h.prefilled, "the prompt was not computed")
        other.add_request(pd_req("refused", prompt, port, room=4400))
        outs = run([prefill, other], timeout=10)
        assert "page_size mismatch" in outs[(0, "refused")]["finish"]["message"]
        assert prefill.kv_pool_is_fully_free() and other.kv_pool_is_fully_free()
        assert not prefill.role.link.handoffs and not prefill.role.held_back
    finally:
        other.close()
        prefill.close()


def test_a_share_of_zero_queues_a_request_only_once_its_page_list_came(tiny_model):
    """The A/B switch for the GPU measurement: with --disaggregation-prefill-ahead-share 0 nothing is computed
    before the decode's page list, as before computing ahead existed."""
    prompt = list(range(40, 80))
    expected = colocated_outputs(tiny_model, {"waits": prompt}, n=4)
    prefill, decode, port = make_pair(tiny_model, disaggregation_prefill_ahead_share=0.0)
    try:
        prefill.add_request(pd_req("waits", prompt, port, room=4500, n=4))
        for _ in range(3):
            prefill.step()
        h = prefill.role.link.handoffs[4500]
        assert h.room in prefill.role.held_back and h.pages_computed == 0 and not h.req.stage_marks.marked & {tl.QUEUED}
        decode.add_request(pd_req("waits", prompt, port, room=4500, n=4))
        got = run([prefill, decode])
        assert got[(1, "waits")]["ids"] == expected["waits"]
        assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()
    finally:
        prefill.close()
        decode.close()
