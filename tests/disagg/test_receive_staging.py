"""The decode's receive staging (`--disaggregation-staging-mb`): the prefill asks for a slot as it starts computing a
request, writes the KV packed into it when the answer came first, and the decode unpacks it into its pages before it
commits; output equals colocated whatever the decode's page placement, requests queued at the prefill hold no slot,
and every slot comes back, on success, on failure, when the arena is too small and when the answer came too late."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from test_pd_schedulers import check_pd_equals_colocated, colocated_ids, make_pair, pd_req, run

from pdserve.disagg.control_messages import PeerDead, PeerGone, StagingSlot
from pdserve.disagg.prefill import _staged_destinations
from pdserve.disagg.transfer.base import StagedDestination
from pdserve.disagg.transfer.receive_staging import ReceiveStaging
from pdserve.mem_cache.kv_pool import KVLayout, KVPool


def small_pool() -> KVPool:
    return KVPool(KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, num_pages=64,
                           dtype=torch.bfloat16), "cpu")


WAIT_S = 60.0  # transfer and fence timeouts no test's steps come near


def staging_pair(model, **kw):
    """A pair whose prefill waits for its staging answers as long as it takes: staging, not timing, is under test."""
    return make_pair(model, **{"disaggregation_staging_wait_ms": 30000.0, **kw})


@pytest.fixture
def staged_pair(tiny_model):
    prefill, decode, port = staging_pair(tiny_model, disaggregation_staging_mb=1, disaggregation_enable_kv_checksum=True)
    unpacked = []
    unpack = decode.role.receive.unpack
    decode.role.receive.unpack = lambda room, pages: (unpacked.append(pages), unpack(room, pages))
    try:
        yield prefill, decode, port, unpacked
    finally:
        prefill.close()
        decode.close()


def hold_every_other_page(scheduler, monkeypatch) -> None:
    """Scatter the scheduler's free pages: every other page is held, and given back before its pool is checked."""
    allocator = scheduler.allocator
    held = allocator.alloc(allocator.num_free)
    allocator.free(held[::2])
    still_held = [held[1::2]]
    pool_is_free = scheduler.kv_pool_is_fully_free

    def give_back_then_check() -> bool:
        while still_held:
            allocator.free(still_held.pop())
        return pool_is_free()

    monkeypatch.setattr(scheduler, "kv_pool_is_fully_free", give_back_then_check)


def slots_free(decode) -> bool:
    receive = decode.role.receive
    receive.collect()
    return receive.arena.bytes_in_use == 0 and not (receive.slots or receive.asks or receive.offers)


def staged_missed_late(model, pair, arena_held: int, lengths: tuple[int, ...], seed: int,
                       first_room: int) -> tuple[int, int, int]:
    """PD equals colocated for prompts of `lengths` while `arena_held` bytes of the decode's arena are others', and
    every slot is back afterwards; the handoffs staged, missed and late. The pair is closed."""
    prefill, decode, _ = pair
    receive = decode.role.receive
    try:
        held = receive.arena.try_acquire(arena_held)
        check_pd_equals_colocated(model, pair, lengths, seed, first_room)
        receive.arena.release(held)
        assert slots_free(decode)
        return receive.staged, receive.missed, receive.late
    finally:
        prefill.close()
        decode.close()


def step_until(done, scheds, timeout: float = 30.0) -> None:
    """Step the schedulers in turn until `done()` holds after one of their steps."""
    deadline = time.monotonic() + timeout
    while True:
        for s in scheds:
            s.step()
            if done():
                return
        assert time.monotonic() < deadline, "the schedulers never got there"


class AcceptingEngine:
    """A transfer engine that takes every registration (the staging's bookkeeping is under test, not its bytes)."""

    name = "tcp"

    def register(self, ptr: int, length: int, device: str = "cpu") -> None:
        pass


def test_the_decode_gives_slots_to_asks_oldest_first_and_frees_each_once_written():
    pool = small_pool()
    receive = ReceiveStaging(AcceptingEngine(), pool, 2 * pool.layout.num_layers * pool.layout.page_bytes * 2)
    assert receive.offer(1, 2) and receive.offer(2, 2)
    assert not receive.offer(3, 3) and not receive.offer(4, 0)  # larger than the arena; nothing to write
    assert not receive.ask(9) and receive.ask(1) and not receive.ask(1) and receive.ask(2)
    assert receive.grant() == [1] and receive.grant() == [] and list(receive.asks) == [2]  # the arena is full
    receive.unpack(1, [5, 7])
    assert receive.grant() == []  # the unpack may not have run yet
    receive.collect()
    assert receive.grant() == [2]
    receive.written_in_place(2)  # its prefill wrote the pages before the answer came: freed unread, late
    receive.offer(5, 1)
    receive.written_in_place(5)  # offered, never asked for
    assert receive.snapshot() == {"bytes": receive.arena.size, "slots": 0, "staged": 1, "scattered": 1, "missed": 2,
                                  "late": 1}
    assert receive.offer(6, 1) and receive.ask(6) and receive.grant() == [6]
    assert not receive.withdraw(6) and 6 in receive.slots  # its handoff failed, its prefill may still write: fenced
    receive.drop(6)
    taken = receive.arena.try_acquire(receive.arena.size)
    assert receive.offer(7, 1) and receive.ask(7) and receive.grant() == []
    receive.drop(7)  # its handoff failed while it waited for room
    receive.arena.release(taken)
    assert receive.grant() == [] and receive.arena.bytes_in_use == 0
    assert not (receive.slots or receive.asks or receive.offers)


def test_staged_handoffs_equal_colocated_on_scattered_decode_pages(tiny_model, staged_pair, monkeypatch):
    """The decode's free pages are every other page, so each prompt's pages are scattered there; chunked prompts
    (70, 130 tokens) land in their slot in several writes. The checksum is on: the unpacked pages are compared."""
    prefill, decode, port, unpacked = staged_pair
    hold_every_other_page(decode, monkeypatch)
    check_pd_equals_colocated(tiny_model, (prefill, decode, port), (3, 31, 70, 130), seed=3, first_room=900)
    assert len(unpacked) == 4 and any(b - a != 1 for pages in unpacked for a, b in zip(pages, pages[1:]))
    assert slots_free(decode) and decode.kv_pool_is_fully_free()


def test_a_handoff_that_finds_no_room_in_the_arena_writes_its_pages(tiny_model):
    """Its ask waits for room on the decode while its prefill waits for the answer
    (`--disaggregation-staging-wait-ms`): then the KV goes into the pages, and `kv_done` says so, which ends the ask."""
    pair = make_pair(tiny_model, disaggregation_staging_mb=1)
    full = pair[1].role.receive.arena.size
    assert staged_missed_late(tiny_model, pair, full, (31,), seed=4, first_room=950) == (0, 1, 0)


def test_a_failed_staged_handoff_gives_its_slot_back_once_the_prefill_confirms(staged_pair):
    """The decode gives up on a staged handoff while the prefill may still write into the slot: the slot stays
    fenced with the pages until the prefill confirms, then both come back."""
    prefill, decode, port, unpacked = staged_pair
    for s in (prefill, decode):
        s.add_request(pd_req("gone", list(range(10, 50)), port, room=990))
    step_until(lambda: 990 in decode.role.receive.slots, [prefill, decode])  # the page list sent, a slot taken
    decode.abort_request("gone")
    run([prefill, decode])
    assert not unpacked and 990 not in decode.role.quarantine
    assert slots_free(decode) and decode.kv_pool_is_fully_free() and prefill.kv_pool_is_fully_free()


@pytest.mark.parametrize("ending", ["prefill gone", "timeouts"])
def test_a_slot_given_to_a_prefill_that_stops_answering_comes_back(tiny_model, ending):
    """The slot is given, then the prefill never runs again: the decode fails the handoff and keeps the slot fenced
    with its pages (the prefill may still write), until the prefill's process is gone (`peer_gone`) or the
    transfer and fence timeouts pass. The timeouts are long and the decode's clock is moved past them, so no
    stall of a loaded machine can end them early."""
    prefill, decode, port = staging_pair(tiny_model, disaggregation_waiting_timeout=WAIT_S,
                                         disaggregation_fence_timeout=WAIT_S)
    receive, link = decode.role.receive, decode.role.link
    skew = [0.0]
    link.clock = lambda: time.monotonic() + skew[0]
    try:
        for s in (prefill, decode):
            s.add_request(pd_req("frozen", list(range(10, 50)), port, room=1400))
        step_until(lambda: 1400 in receive.slots, [prefill, decode])
        if ending == "prefill gone":
            link.channel.complete(PeerDead(f"127.0.0.1:{port}"))
        else:
            skew[0] = WAIT_S + 1  # the transfer's timeout passes
        step_until(lambda: 1400 in decode.role.quarantine, [decode])
        assert 1400 in receive.slots
        if ending == "prefill gone":
            link.channel.complete(PeerGone(f"127.0.0.1:{port}"))
        else:
            skew[0] = 2 * (WAIT_S + 1)  # and then the fence's
        step_until(lambda: not decode.has_work(), [decode])
        assert slots_free(decode) and decode.kv_pool_is_fully_free() and receive.staged == 0
    finally:
        prefill.close()
        decode.close()


def test_requests_queued_at_the_prefill_hold_no_slot_and_are_staged_in_turn(tiny_model):
    """The decode's arena has room for one 40-token handoff; four such requests queue at the prefill. Each takes
    the slot as its computing begins, once the one before was unpacked: all four are staged (reserved with their
    pages, as before, three would have found the arena full and been written into their pages)."""
    pair = staging_pair(tiny_model)
    receive = pair[1].role.receive
    others = receive.arena.size - receive.slot_bytes(10)
    assert staged_missed_late(tiny_model, pair, others, (40, 40, 40, 40), seed=6, first_room=1200) == (4, 0, 0)


def test_a_slot_given_after_the_writes_began_comes_free_at_kv_done(tiny_model):
    """The prefill computes the prompt before its page list comes, asks for the slot then and, waiting for no answer,
    writes the pages at once; the decode answers after that: the prefill drops the answer, its `kv_done` says "not
    staged", and the decode frees the slot unread (missed and late)."""
    prefill, decode, port = make_pair(tiny_model)
    prefill.role.slot_asks.wait_s = 0.0
    receive, writes = decode.role.receive, []
    submit, prefill.role.writers.submit = prefill.role.writers.submit, writes.append  # held until the decode answered
    prompt = list(range(10, 41))
    try:
        for s in (prefill, decode):
            s.add_request(pd_req("late", prompt, port, room=1300))
        step_until(lambda: writes and writes[-1].final, [decode, prefill])
        step_until(lambda: 1300 in receive.slots, [decode])
        for job in writes:
            submit(job)
        prefill.role.writers.submit = submit
        outs = run([prefill, decode])
        assert outs[(1, "late")]["ids"] == colocated_ids(tiny_model, [prompt])[0]
        assert (receive.staged, receive.missed, receive.late) == (0, 1, 1) and slots_free(decode)
        assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()
    finally:
        prefill.close()
        decode.close()


def test_the_prefill_refuses_a_slot_it_cannot_fill():
    slot = StagingSlot(1, bases=[4096, 8192], num_pages=2)
    assert _staged_destinations(slot, 2, 2) == [StagedDestination(4096, 2), StagedDestination(8192, 2)]
    assert _staged_destinations(StagingSlot(1), 2, 2) == [None, None]
    for msg, error in [(replace(slot, bases=[4096]), "for 2 decode ranks"),
                       (replace(slot, bases=[4096, 0]), "for 2 decode ranks"),
                       (replace(slot, num_pages=3), "of 3 pages for 2 pages")]:
        with pytest.raises(ValueError, match=error):
            _staged_destinations(msg, 2, 2)


def test_a_prefill_with_scattered_pages_packs_its_writes(tiny_model, monkeypatch):
    """Without receive staging: the prefill's free pages are every other page, the decode's one run, so every
    write is packed (one span per layer and K/V instead of one per page); output equals colocated."""
    prefill, decode, port = make_pair(tiny_model)
    hold_every_other_page(prefill, monkeypatch)
    mover = prefill.role.writers.mover
    packed_writes = []
    write_packed = mover._write_packed
    monkeypatch.setattr(mover, "_write_packed", lambda session, parts: (packed_writes.append(parts),
                                                                        write_packed(session, parts)))
    try:
        check_pd_equals_colocated(tiny_model, (prefill, decode, port), (31, 70), seed=5, first_room=970)
        assert packed_writes and all(part.num_pages > 1 for parts in packed_writes for part in parts)
    finally:
        prefill.close()
        decode.close()
