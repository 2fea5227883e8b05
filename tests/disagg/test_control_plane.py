"""The PD control plane: peers' messages and helper threads' results in separate queues, each stamped with when it
became known; the decode's `kv_landed` marked when the prefill's `kv_done` arrived, not when a step read it."""

from __future__ import annotations

import select
import time

import pytest
from test_pd_schedulers import make_pair, pd_req, send_page_lists

from pdserve.disagg.control_channel import ControlChannel
from pdserve.disagg.control_messages import FirstToken, KVDone, PeerDead, WriteDone
from pdserve.disagg.handoff import KVPoll
from pdserve.timeline import KV_LANDED, KV_WRITES_LANDED

WAIT_S = 30.0  # bounds every wait below; a loaded box takes far less


@pytest.fixture
def channel():
    ch = ControlChannel("127.0.0.1", "test-control")
    yield ch
    ch.close()


def readable(fd: int, timeout_s: float = WAIT_S) -> bool:
    return bool(select.select([fd], [], [], timeout_s)[0])


def test_peer_messages_and_completions_stay_apart(channel):
    before = time.monotonic()
    channel.complete(WriteDone(7, 1))
    channel.complete(PeerDead("127.0.0.1:1"))
    sender = ControlChannel("127.0.0.1", "test-peer", listen=False)
    try:
        sender.send(channel.endpoint, KVDone(7, "r", FirstToken(7, 3)))
        assert readable(channel.wakeup_fd)
        drained = channel.drain()
        deadline = time.monotonic() + WAIT_S
        while not drained.from_peers and time.monotonic() < deadline:  # the wake-up may be the completions'
            assert readable(channel.wakeup_fd)
            drained = channel.drain()
    finally:
        sender.close()
    assert [k.msg for k in drained.completions] in ([WriteDone(7, 1), PeerDead("127.0.0.1:1")], [])
    assert [k.msg for k in drained.from_peers] == [KVDone(7, "r", FirstToken(7, 3))]
    assert all(before <= k.at <= time.monotonic() for k in drained.from_peers + drained.completions)


def test_a_peer_message_is_never_a_completion(channel):
    with pytest.raises(TypeError, match="kv_done"):
        channel.complete(KVDone(7, "r", FirstToken(7, 3)))
    assert channel.drain().completions == []


def test_decode_marks_kv_landed_when_kv_done_arrives(tiny_model):
    prefill, decode, port = make_pair(tiny_model, page_size=4)
    try:
        prompt = list(range(20, 60))
        for s in (prefill, decode):
            s.add_request(pd_req("landed", prompt, port, room=8100, n=4))
        send_page_lists(decode, range(8100, 8101), WAIT_S)
        deadline = time.monotonic() + WAIT_S
        prefill_marks: dict[str, float] = {}
        while "landed" in prefill.reqs:  # until the prefill's last write landed and its kv_done left
            assert time.monotonic() < deadline
            for out in prefill.step():
                prefill_marks |= out.stage_marks or {}
        assert decode.role.link.handoffs[8100].poll == KVPoll.WAITING_FOR_INPUT  # no decode step read kv_done yet
        assert readable(decode.role.link.channel.wakeup_fd)
        time.sleep(0.2)  # a step that comes late (kv_done reaches the decode's channel meanwhile: it was sent)
        step_at = time.monotonic()
        decode_marks: dict[str, float] = {}
        for out in decode.step():
            decode_marks |= out.stage_marks or {}
        assert prefill_marks[KV_WRITES_LANDED] <= decode_marks[KV_LANDED] < step_at
    finally:
        prefill.close()
        decode.close()
