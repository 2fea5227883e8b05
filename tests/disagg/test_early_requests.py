"""The prefill's store of early claims and of refusals waiting for their claim: bounded, expiring, taken once."""

from __future__ import annotations

from pdserve.disagg.control_messages import Failed
from pdserve.disagg.early_requests import EarlyRequests


def test_refusals_wait_for_their_claim_bounded_and_expiring():
    store = EarlyRequests(max_pages=64, ttl_s=5.0, max_count=2)
    for room in (1, 2, 3):  # the oldest makes room
        store.refuse(Failed(room, "bad grammar", status=400), now=float(room))
    assert store.take_refusal(1) is None
    assert store.take_refusal(2) == Failed(2, "bad grammar", status=400) and store.take_refusal(2) is None
    store.expire(now=7.5)  # room 3's answer was kept until 8.0
    assert store.take_refusal(3) is not None
    store.refuse(Failed(4, "x"), now=0.0)
    store.expire(now=5.5)
    assert store.take_refusal(4) is None
