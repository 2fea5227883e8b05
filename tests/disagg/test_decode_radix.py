"""`--disaggregation-decode-enable-radix-cache`: the decode server keeps finished requests' pages in a radix cache
of its own and receives only the pages it lacks. In-process schedulers over the tcp backend; the test counts the
bytes the prefill's transfer engine really writes."""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import pytest
from test_pd_schedulers import engine_args, greedy, make_pair, pd_req, run

from pdserve.config import ServerArgs
from pdserve.disagg.control_messages import TransferRequest
from pdserve.disagg.handoff import KVPoll, checked_cached_pages
from pdserve.scheduler.request import Req
from pdserve.disagg.factory import create_scheduler

PAGE = 4  # engine_args' page size


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


class CountingWrites:
    """Wraps the prefill's transfer engine: pages written (bytes / bytes of one page, all layers, K and V)."""

    def __init__(self, prefill):
        layout = prefill.runner.pool.layout
        self.page_nbytes = layout.page_bytes * 2 * layout.num_layers
        self.nbytes = 0
        self.gate = threading.Event()
        self.gate.set()
        self.write = prefill.role.link.engine.write
        prefill.role.link.engine.write = self

    def __call__(self, session, src, dst, lengths):
        assert self.gate.wait(30), "the test never opened the write gate"
        self.nbytes += sum(lengths)
        return self.write(session, src, dst, lengths)

    def take_pages(self) -> int:
        pages, rest = divmod(self.nbytes, self.page_nbytes)
        assert rest == 0
        self.nbytes = 0
        return pages


@pytest.fixture(scope="module", params=[True, False], ids=["decode-radix", "no-decode-radix"])
def pair(model, request):
    prefill, decode, port = make_pair(model, disaggregation_decode_enable_radix_cache=request.param)
    writes = CountingWrites(prefill)
    yield prefill, decode, port, writes, request.param
    prefill.close()
    decode.close()


def colocated_outputs(model, prompts: list[list[int]], n: int = 8) -> list[list[int]]:
    colocated = create_scheduler(ServerArgs(**engine_args(model, disaggregation_transfer_backend="auto")))
    outs = []
    for i, prompt in enumerate(prompts):
        colocated.add_request(Req(rid=str(i), input_ids=list(prompt), sampling_params=greedy(n)))
        outs.append(run([colocated])[(0, str(i))]["ids"])
    return outs


def serve(pair, rid: str, prompt: list[int], room: int) -> dict:
    prefill, decode, port, _, _ = pair
    for s in (prefill, decode):
        s.add_request(pd_req(rid, prompt, port, room))
    return run([prefill, decode])[(1, rid)]


def pages(tokens: int) -> int:
    return -(-tokens // PAGE)


def test_second_turn_transfers_only_the_pages_the_decode_lacks(model, pair):
    """Turn 2 re-sends turn 1's prompt and answer: the decode holds 12 of its 14 pages (its own output's KV
    included), so 2 pages travel; a branch off turn 1's prompt shares 10 pages. Output equals colocated."""
    prefill, decode, _, writes, radix_on = pair
    rng = random.Random(11)
    turn1 = [rng.randrange(3, 900) for _ in range(42)]
    writes.take_pages()
    got1 = serve(pair, "turn1", turn1, room=1000 + radix_on)
    assert writes.take_pages() == pages(42)
    turn2 = turn1 + got1["ids"] + [rng.randrange(3, 900) for _ in range(6)]  # 56 tokens
    branch = turn1[:40] + [rng.randrange(3, 900) for _ in range(10)]  # 50 tokens
    expected = colocated_outputs(model, [turn1, turn2, branch])
    assert got1["ids"] == expected[0]
    got2 = serve(pair, "turn2", turn2, room=1010 + radix_on)
    held = (42 + 7) // PAGE  # turn 1's finished KV: prompt and 7 of its 8 output tokens (the last has no KV)
    assert writes.take_pages() == (pages(56) - held if radix_on else pages(56))
    got3 = serve(pair, "branch", branch, room=1020 + radix_on)
    assert writes.take_pages() == (pages(50) - 40 // PAGE if radix_on else pages(50))
    assert [got2["ids"], got3["ids"]] == expected[1:]
    assert (got2["cached_tokens"], got3["cached_tokens"]) == ((held * PAGE, 40) if radix_on else (0, 0))
    assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()
    if radix_on:
        assert decode.stats()["kv_cached_tokens"] > 0


def test_abort_during_the_transfer_of_the_missing_pages_frees_both_pools(model, pair):
    prefill, decode, port, writes, radix_on = pair
    rng = random.Random(12)
    prefix = [rng.randrange(3, 900) for _ in range(48)]
    serve(pair, "warm", prefix + [7, 8], room=2000 + radix_on)
    writes.take_pages()
    writes.gate.clear()  # the prefill's writes hang until the decode has given up
    try:
        prompt = prefix + [rng.randrange(3, 900) for _ in range(30)]
        for s in (prefill, decode):
            s.add_request(pd_req("gone", prompt, port, room=2010 + radix_on, n=40))
        deadline = time.monotonic() + 30
        h = None
        while h is None or h.writes_in_flight == 0:  # the prefill is writing the missing pages
            assert time.monotonic() < deadline, "the prefill never started writing"
            prefill.step()
            decode.step()
            h = prefill.role.link.handoffs.get(2010 + radix_on)
        assert h.cached_pages == (48 // PAGE if radix_on else 0)
        assert decode.role.link.handoffs[2010 + radix_on].poll == KVPoll.WAITING_FOR_INPUT
        decode.abort_request("gone")
        assert 2010 + radix_on in decode.role.quarantine  # the pages being written wait until the prefill confirms
    finally:
        writes.gate.set()
    outs = run([prefill, decode])
    assert outs[(1, "gone")]["finish"]["type"] == "abort"
    assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()
    assert writes.take_pages() <= pages(78) - h.cached_pages  # the write that hung, never a cached page
    again = serve(pair, "again", prefix + [9, 10, 11], room=2020 + radix_on)  # the cached prefix still serves
    assert again["cached_tokens"] == (48 if radix_on else 0)
    assert writes.take_pages() == (1 if radix_on else pages(51))


def test_prefill_refuses_a_cached_page_count_beyond_the_prompt(model, pair):
    """A decode that claims to hold the page of the last prompt token (or more) is refused; both pools free."""
    prefill, decode, port, _, _ = pair
    send = decode.role.link.channel.send

    def lying(endpoint, msg):
        if isinstance(msg, TransferRequest):
            msg = dataclasses.replace(msg, cached_pages=len(msg.dst_pages))
        send(endpoint, msg)

    decode.role.link.channel.send = lying
    try:
        for s in (prefill, decode):
            s.add_request(pd_req("liar", list(range(10, 30)), port, room=3000))
        outs = run([prefill, decode])
    finally:
        decode.role.link.channel.send = send
    assert outs[(1, "liar")]["finish"]["type"] == "abort"
    assert "cached_pages 5 is outside [0, 4]" in outs[(0, "liar")]["finish"]["message"]
    assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()


@pytest.mark.parametrize("value,prompt_len,ok", [(0, 1, True), (4, 17, True), (4, 16, False), (-1, 20, False)])
def test_checked_cached_pages_bounds(value, prompt_len, ok):
    if ok:
        assert checked_cached_pages(value, prompt_len, PAGE) == value
    else:
        with pytest.raises(ValueError, match="cached_pages"):
            checked_cached_pages(value, prompt_len, PAGE)


def test_only_a_decode_server_with_the_flag_keeps_a_prefix_cache(model):
    decode = ServerArgs(model_path=model, disaggregation_mode="decode")
    assert not decode.keeps_prefix_cache
    flagged = decode.replace(disaggregation_decode_enable_radix_cache=True)
    assert flagged.keeps_prefix_cache
    assert not flagged.replace(disable_radix_cache=True).keeps_prefix_cache
    assert ServerArgs(model_path=model, disaggregation_mode="prefill").keeps_prefix_cache
