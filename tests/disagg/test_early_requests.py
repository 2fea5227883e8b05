"""The prefill's store of early claims, of refusals waiting for their claim and of aborts waiting for their request:
bounded, expiring, taken once."""

from __future__ import annotations

from pdserve.disagg.control_messages import Abort, Failed
from pdserve.disagg.early_requests import EarlyRequests


def test_refusals_wait_for_their_claim_bounded_and_expiring():
    store = EarlyRequests(max_pages=64, ttl_s=5.0, max_count=2)
    for room in (1, 2, 3):  # the oldest makes room
        store.refusals.put(room, Failed(room, "bad grammar", status=400), now=float(room))
    assert store.refusals.take(1) is None
    assert store.refusals.take(2) == Failed(2, "bad grammar", status=400) and store.refusals.take(2) is None
    store.expire(now=7.5)  # room 3's answer was kept until 8.0
    assert store.refusals.take(3) is not None
    store.refusals.put(4, Failed(4, "x"), now=0.0)
    store.expire(now=5.5)
    assert store.refusals.take(4) is None


def test_aborts_wait_for_their_request_apart_from_refusals_and_expire():
    store = EarlyRequests(max_pages=64, ttl_s=5.0, max_count=2)
    store.aborts.put(7, Abort(7, "bad grammar", status=400), now=0.0)
    store.refusals.put(7, Failed(7, "y"), now=0.0)
    assert store.aborts.take(7) == Abort(7, "bad grammar", status=400) and store.aborts.take(7) is None
    assert store.refusals.take(7) == Failed(7, "y")
    for room in (1, 2, 3):
        store.aborts.put(room, Abort(room), now=float(room))
    assert [room for room, _ in store.aborts.items()] == [2, 3] and len(store.aborts) == 2
    store.expire(now=7.5)
    assert [room for room, _ in store.aborts.items()] == [3]
