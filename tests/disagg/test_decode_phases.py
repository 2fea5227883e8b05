"""The decode's handoff phases as objects (`pdserve/disagg/decode_phases.py`): waiting for pages serves requests in
arrival order, fake-transfer ones first, none past one that does not fit, and asks for no step until the pages
available changed; refusals wait for their prefill's route."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.disagg.control_messages import Abort, RouteResolved
from pdserve.disagg.decode_phases import Routes, WaitingForPages
from pdserve.disagg.handoff import Handoff
from pdserve.messages import FAKE_BOOTSTRAP_HOST

KNOWN, UNKNOWN = "10.0.0.1", "10.0.0.2"
PORT = 8998


def handoff(room: int, host: str) -> Handoff:
    req = SimpleNamespace(bootstrap_host=host, bootstrap_port=PORT, finished=False)
    return Handoff(req, room, deadline=0.0)


def phases() -> tuple[Routes, WaitingForPages]:
    routes = Routes(refusal_ttl_s=10.0)
    routes.resolved(RouteResolved(f"{KNOWN}:{PORT}", route={"ranks": {}}))
    return routes, WaitingForPages(routes)


class Taker:
    """Takes what fits in `room` pages, each request holding back one page for its growth."""

    def __init__(self, room: int):
        self.room, self.taken = room, []

    def __call__(self, h: Handoff, reserved: int) -> int | None:
        if reserved + 1 > self.room:
            return None
        self.taken.append(h.room)
        return 1


def test_fake_requests_first_then_handoffs_with_a_route_in_arrival_order():
    _, waiting = phases()
    waiting.add_fake(handoff(1, FAKE_BOOTSTRAP_HOST))
    waiting.add_fake(handoff(2, FAKE_BOOTSTRAP_HOST))
    bootstrapping = [handoff(3, KNOWN), handoff(4, UNKNOWN), handoff(5, KNOWN)]
    assert waiting.ready(bootstrapping) == [bootstrapping[0], bootstrapping[2]]
    take = Taker(room=10)
    waiting.serve(bootstrapping, reserved=0, take=take, available=lambda: 10)
    assert take.taken == [1, 2, 3, 5] and not waiting.has_fake()


def test_none_takes_pages_past_one_that_did_not_fit_and_no_step_until_pages_change():
    _, waiting = phases()
    for room in (1, 2):
        waiting.add_fake(handoff(room, FAKE_BOOTSTRAP_HOST))
    bootstrapping = [handoff(3, KNOWN)]
    take = Taker(room=2)
    waiting.serve(bootstrapping, reserved=1, take=take, available=lambda: 7)
    assert take.taken == [1] and waiting.has_fake()  # the second fake did not fit: the handoff waits behind it
    assert not waiting.may_fit(7, bootstrapping)
    assert waiting.may_fit(8, bootstrapping)
    waiting.serve(bootstrapping, reserved=0, take=Taker(room=5), available=lambda: 8)
    assert not waiting.has_fake() and waiting.may_fit(8, bootstrapping)  # nothing blocked: a step may serve more


def test_a_fake_request_aborted_while_it_waited_leaves_unoffered():
    _, waiting = phases()
    aborted = handoff(1, FAKE_BOOTSTRAP_HOST)
    aborted.req.finished = True
    waiting.add_fake(aborted)
    take = Taker(room=0)  # nothing fits: only an aborted request can leave
    waiting.serve([], reserved=0, take=take, available=lambda: 0)
    assert take.taken == [] and not waiting.has_fake() and not waiting.may_fit(1, [])


def test_refusals_wait_for_their_prefill_route_and_expire():
    routes, _ = phases()
    late = f"{UNKNOWN}:{PORT}"
    routes.refuse_when_known(late, Abort(1, "bad grammar", status=400), now=0.0)
    routes.refuse_when_known(f"{KNOWN}:{PORT}", Abort(2, "bad grammar", status=400), now=0.0)
    assert routes.refusals_due(late) == []  # its lookup has not ended
    assert routes.refusals_due(f"{KNOWN}:{PORT}") == [Abort(2, "bad grammar", status=400)]
    assert routes.refusals_due(f"{KNOWN}:{PORT}") == [] and routes.num_refusals() == 1
    routes.expire_refusals(now=11.0)
    routes.resolved(RouteResolved(late, error="refused"))
    assert routes.refusals_due(late) == [] and routes.num_refusals() == 0
