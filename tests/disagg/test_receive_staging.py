"""The decode's receive staging (`--disaggregation-staging-mb`): the prefill writes a handoff's KV packed into a slot,
the decode unpacks it into its pages before it commits; output equals colocated whatever the decode's page placement,
and every slot comes back, on success, on failure and when the arena is too small."""

from __future__ import annotations

import pytest
from test_pd_schedulers import check_pd_equals_colocated, make_pair, pd_req, run

from pdserve.disagg.control_messages import TransferRequest
from pdserve.disagg.prefill import _staged_destinations
from pdserve.disagg.transfer.base import StagedDestination


@pytest.fixture
def staged_pair(tiny_model):
    prefill, decode, port = make_pair(tiny_model, disaggregation_staging_mb=1, disaggregation_enable_kv_checksum=True)
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
    decode.role.receive.collect()
    return decode.role.receive.arena.bytes_in_use == 0 and not decode.role.receive.slots


def test_staged_handoffs_equal_colocated_on_scattered_decode_pages(tiny_model, staged_pair, monkeypatch):
    """The decode's free pages are every other page, so each prompt's pages are scattered there; chunked prompts
    (70, 130 tokens) land in their slot in several writes. The checksum is on: the unpacked pages are compared."""
    prefill, decode, port, unpacked = staged_pair
    hold_every_other_page(decode, monkeypatch)
    check_pd_equals_colocated(tiny_model, (prefill, decode, port), (3, 31, 70, 130), seed=3, first_room=900)
    assert len(unpacked) == 4 and any(b - a != 1 for pages in unpacked for a, b in zip(pages, pages[1:]))
    assert slots_free(decode) and decode.kv_pool_is_fully_free()


def test_a_handoff_that_finds_no_room_in_the_arena_writes_its_pages(tiny_model):
    prefill, decode, port = make_pair(tiny_model, disaggregation_staging_mb=1)
    receive = decode.role.receive
    try:
        taken = receive.arena.try_acquire(receive.arena.size)  # the arena is full
        check_pd_equals_colocated(tiny_model, (prefill, decode, port), (31,), seed=4, first_room=950)
        assert not receive.slots
        receive.arena.release(taken)
        assert slots_free(decode)
    finally:
        prefill.close()
        decode.close()


def test_a_failed_staged_handoff_gives_its_slot_back_once_the_prefill_confirms(staged_pair):
    """The decode gives up on a staged handoff while the prefill may still write into the slot: the slot stays
    fenced with the pages until the prefill confirms, then both come back."""
    prefill, decode, port, unpacked = staged_pair
    for s in (prefill, decode):
        s.add_request(pd_req("gone", list(range(10, 50)), port, room=990))
    for _ in range(200):  # until the decode sent its page list (and took a slot)
        for s in (prefill, decode):
            s.step()
        if 990 in decode.role.receive.slots:
            break
    assert 990 in decode.role.receive.slots
    decode.abort_request("gone")
    run([prefill, decode])
    assert not unpacked and 990 not in decode.role.quarantine
    assert slots_free(decode) and decode.kv_pool_is_fully_free() and prefill.kv_pool_is_fully_free()


def test_the_prefill_refuses_staging_it_cannot_fill():
    def request(**kw) -> TransferRequest:
        fields = dict(room=1, rid="r", control="c", session="s", peer={}, kv_base=1, dst_pages=[4, 9, 2],
                      cached_pages=1, staging=[4096, 8192], staging_pages=2)
        return TransferRequest(**{**fields, **kw})

    assert _staged_destinations(request(), 2, 2) == [StagedDestination(4096, 2), StagedDestination(8192, 2)]
    assert _staged_destinations(request(staging=[], staging_pages=0), 2, 1) == [None, None]
    for msg, decode_tp, prefill_tp, error in [
        (request(), 2, 1, "whole tokens"),
        (request(staging=[4096]), 2, 2, "for 2 decode ranks"),
        (request(staging=[4096, 0]), 2, 2, "for 2 decode ranks"),
        (request(staging_pages=3), 2, 2, "of 3 pages for 2 pages"),
    ]:
        with pytest.raises(ValueError, match=error):
            _staged_destinations(msg, decode_tp, prefill_tp)


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
