"""The prefill's handoff phases as objects (`pdserve/disagg/prefill_phases.py`): held-back rooms are queued oldest
first, none past one that does not fit, while the pages computed ahead of page lists stay within the budget, and
leave when their page list comes or they fail; a room's offered staging slot is asked for once and its writes wait
for the answer at most the wait; a room's `kv_done` is sent once, after every rank's writes landed, and dropped when
the handoff is released."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.disagg.control_messages import FirstToken, KVDone
from pdserve.disagg.handoff import Handoff
from pdserve.disagg.prefill_phases import FinalWrites, HeldBack, SlotAsks

PAGE_SIZE = 4


def handoff(room: int, pages: int) -> Handoff:
    """A handoff whose prompt fills `pages` pages, the last one partly."""
    return Handoff(SimpleNamespace(input_ids=[7] * (pages * PAGE_SIZE - 1)), room, deadline=0.0)


def kv_done(room: int) -> KVDone:
    return KVDone(room, f"r{room}", FirstToken(room, first_token=11))


def test_held_rooms_are_queued_oldest_first_within_the_budget_none_past_one_that_does_not_fit():
    held = HeldBack(max_pages_ahead=10, page_size=PAGE_SIZE)
    queued = handoff(1, pages=3)  # queued earlier, still without its page list: counts against the budget
    waiting = [handoff(2, pages=4), handoff(3, pages=5), handoff(4, pages=1)]
    for h in waiting:
        held.hold(h)
    assert held.due([queued, *waiting]) == [waiting[0]]  # 3 + 4 fit; 3 + 4 + 5 do not, and room 4 waits behind 3
    assert 2 not in held and 3 in held and 4 in held and len(held) == 2
    assert held.due([queued, *waiting]) == []  # nothing freed the budget: the same pass queues nothing
    assert held.due(waiting[1:]) == waiting[1:]  # the queued ones got their page lists: 5 + 1 fit
    assert not held


def test_a_held_room_leaves_when_its_page_list_comes_or_it_fails():
    held = HeldBack(max_pages_ahead=0, page_size=PAGE_SIZE)  # a share of 0: every room waits for its page list
    first, second = handoff(1, pages=1), handoff(2, pages=1)
    held.hold(first)
    held.hold(second)
    assert held.due([first, second]) == []
    assert held.leave(1) is first  # its page list came: the role queues it
    assert held.leave(2) is second and held.leave(2) is None  # it failed; a second leave finds nothing
    assert held.handoffs() == [] and len(held) == 0


def test_the_only_writer_sends_kv_done_itself_and_nothing_is_held_for_the_leader():
    final = FinalWrites()
    done = kv_done(5)
    assert final.hold_unless_sole(done, sole_writer=True) is done
    h = handoff(5, pages=1)
    assert 5 not in final and final.due(h) is None


def test_kv_done_is_due_once_after_every_ranks_writes_landed():
    final = FinalWrites()
    done = kv_done(6)
    assert final.hold_unless_sole(done, sole_writer=False) is None
    h = handoff(6, pages=2)
    h.writes_in_flight = 2  # one final write per rank
    assert final.due(h) is None and 6 in final  # a rank's write is still in flight
    h.writes_in_flight = 0
    assert final.due(h) is done
    assert final.due(h) is None and 6 not in final  # sent once


def test_kv_done_is_dropped_when_the_handoff_is_released():
    final = FinalWrites()
    final.hold_unless_sole(kv_done(7), sole_writer=False)
    final.drop(7)
    final.drop(7)  # a released room that never held one, or one already dropped, is no error
    assert 7 not in final and final.due(handoff(7, pages=1)) is None


def test_a_staging_slot_is_asked_for_once_and_writes_wait_for_the_answer_at_most_the_wait():
    asks = SlotAsks(wait_s=0.5)
    assert not asks.ask(1)  # its decode offered none
    asks.offer(1)
    asks.offer(2)
    assert asks.ask(1) and not asks.ask(1) and asks.waiting(1)
    assert asks.seconds_left(now=10.0) is None  # asked, no write held yet: no wait runs
    assert asks.holds(1, now=10.0) and asks.holds(1, now=10.4)  # the first write held starts the wait
    assert abs(asks.seconds_left(now=10.2) - 0.3) < 1e-9
    assert asks.expired(now=10.5) == [] and asks.expired(now=10.6) == [1]  # no answer in time
    assert not asks.holds(1, now=10.7) and not asks.answered(1)  # it came too late
    assert asks.ask(2) and asks.holds(2, now=0.0) and asks.answered(2) and not asks.holds(2, now=0.1)
    asks.offer(3)
    asks.drop(3)  # its handoff failed
    assert not asks.ask(3) and asks.expired(now=99.0) == []
