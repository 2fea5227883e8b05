"""Hostile peers against a prefill and a decode scheduler (tcp backend, one process): malformed and unsigned
control messages, floods of early claims, forged KV writes and route registrations, damaged KV pages."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from test_pd_schedulers import check_pd_equals_colocated, make_pair, pd_req, run

from pdserve.cluster_auth import AuthError, ClusterAuth
from pdserve.disagg.bootstrap import PrefillRankInfo, _request
from pdserve.disagg.control_messages import Abort
from pdserve.disagg.early_requests import MAX_EARLY_REQUESTS
from pdserve.disagg.factory import create_scheduler
from pdserve.scheduler.scheduler import Scheduler
from pdserve.disagg.handoff import PEER_FAILED
from pdserve.disagg.transfer.base import TransferError
from pdserve.disagg.control_transport import ControlClient

SECRET = "test-cluster-secret"


@contextmanager
def running_pair(model, **kw) -> Iterator[tuple[Scheduler, Scheduler, int]]:
    prefill, decode, port = make_pair(model, **kw)
    try:
        yield prefill, decode, port
    finally:
        prefill.close()
        decode.close()


@pytest.fixture(scope="module")
def open_pair(tiny_model):
    with running_pair(tiny_model) as pair:
        yield pair


@pytest.fixture(scope="module")
def secret_pair(tiny_model):
    with running_pair(tiny_model, disaggregation_secret=SECRET) as pair:
        yield pair


def refused(endpoint: str, *messages: dict, auth: ClusterAuth | None = None) -> list[str]:
    """Send each message on one connection; the error reply of each (the receiver answers a refused message)."""
    client = ControlClient(endpoint, timeout_s=10.0, auth=auth)
    errors = []
    try:
        for msg in messages:
            client.send(msg)
            with pytest.raises(TransferError) as exc:
                client.recv("refusal")
            errors.append(str(exc.value))
    finally:
        client.close()
    return errors


def delivered(endpoint: str, *messages: dict) -> None:
    """Send well-formed messages (which get no reply) and return once the receiver has queued them all."""
    client = ControlClient(endpoint, timeout_s=30.0)
    try:
        for msg in messages:
            client.send(msg)
        client.send({"type": "abort"})  # malformed: its refusal comes after every message before it was queued
        with pytest.raises(TransferError, match="Abort"):
            client.recv("refusal")
    finally:
        client.close()


def serves_a_pd_request(pair, rid: str, room: int) -> None:
    prefill, decode, port = pair
    for s in (prefill, decode):
        s.add_request(pd_req(rid, [5, 6, 7, 8, 9, 10, 11], port, room))
    outs = run([prefill, decode])
    assert outs[(1, rid)]["finish"]["type"] == "length" and len(outs[(1, rid)]["ids"]) == 8
    assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()


def transfer_request(room: int, **fields) -> dict:
    return {"type": "transfer_request", "room": room, "rid": "x", "control": "127.0.0.1:1", "session": "127.0.0.1:1",
            "peer": {}, "kv_base": 4096, "dst_pages": [1], **fields}


def kv_done(room: int, **aux) -> dict:
    return {"type": "kv_done", "room": room, "rid": "x", "aux": {"room": room, "first_token": 5, **aux}}


def test_malformed_control_messages_are_dropped_and_both_roles_keep_serving(open_pair):
    prefill, decode, _ = open_pair
    decode_errors = refused(decode.role.link.channel.endpoint,
                            {"type": "peer_dead", "room": 1},  # in-process only: never from a peer
                            kv_done(7, logprob=-0.5, top_logprobs=[[1, "x"], "zzz"]),
                            kv_done(7, first_token="5"),
                            {"type": "kv_done", "room": 7, "rid": "x", "aux": [1, 2]},
                            {"type": "failed", "room": -3},
                            {"type": "failed", "room": True},
                            {"type": "no_such_message", "room": 1},
                            {"room": 1},
                            {**kv_done(7), "staged": 1},
                            {"type": "staging_ask", "room": "7"})
    assert "peer_dead is never accepted from a peer" in decode_errors[0]
    assert "top_logprobs" in decode_errors[1] and "first_token must be int" in decode_errors[2]
    assert "KVDone.staged must be bool" in decode_errors[8] and "StagingAsk.room must be int" in decode_errors[9]
    prefill_errors = refused(prefill.role.link.channel.endpoint,
                             {"type": "write_done", "room": 3},
                             {"type": "write_done", "room": 3, "final": True, "count": 1},
                             transfer_request(3, peer="zzz"),
                             transfer_request(3, dst_pages=[1, "2"]),
                             transfer_request(3, kv_base=None),
                             transfer_request(3, extra=1),
                             transfer_request(3, rank_targets=[["127.0.0.1:1", "4096"]]),
                             transfer_request(3, rank_targets="127.0.0.1:1"),
                             {"type": "abort"},
                             {"type": "abort", "room": 3, "status": "400"},
                             transfer_request(3, staging_offered=1),
                             {"type": "staging_slot", "room": 3, "bases": [4096, "8192"], "num_pages": 1},
                             {"type": "staging_slot", "room": 3, "num_pages": 1.0})
    assert all("never accepted from a peer" in e for e in prefill_errors[:2])
    assert "peer must be dict" in prefill_errors[2]
    assert "rank_targets[] must be int" in prefill_errors[6] and "rank_targets must be a list" in prefill_errors[7]
    assert "Abort.status must be int" in prefill_errors[9]
    assert "staging_offered must be bool" in prefill_errors[10] and "bases[] must be int" in prefill_errors[11]
    assert "StagingSlot.num_pages must be int" in prefill_errors[12]
    delivered(decode.role.link.channel.endpoint, {"type": "staging_ask", "room": 4003})  # rooms nobody holds
    delivered(prefill.role.link.channel.endpoint, {"type": "staging_slot", "room": 4003, "bases": [4096], "num_pages": 1})
    serves_a_pd_request(open_pair, "after-garbage", room=4001)


@contextmanager
def fake_bootstrap(route: object) -> Iterator[int]:
    """A bootstrap server that answers every GET with `route` as JSON; yields its port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(route).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_malformed_routes_and_peer_layouts_fail_only_their_request(open_pair):
    prefill, decode, _ = open_pair
    routes = [[1, 2], {**decode.role.link.description, "ranks": {"0": {"control_endpoint": 5}}},
              {**decode.role.link.description, "kv_layout": [1], "ranks": {}}]
    for i, route in enumerate(routes):
        with fake_bootstrap(route) as port:
            decode.add_request(pd_req(f"bad-route-{i}", [5, 6, 7], port, room=4200 + i))
            finish = run([decode])[(0, f"bad-route-{i}")]["finish"]
        assert finish["status_code"] == PEER_FAILED and "prefill handshake failed" in finish["message"]
    prefill.add_request(pd_req("bad-layout", [5, 6, 7], 1, room=4300))
    delivered(prefill.role.link.channel.endpoint, transfer_request(4300, peer={**decode.role.link.description, "kv_layout": [1]}))
    finish = run([prefill])[(0, "bad-layout")]["finish"]
    assert finish["status_code"] == PEER_FAILED and "decode peer refused: num_layers mismatch" in finish["message"]
    prefill.add_request(pd_req("bad-targets", [5, 6, 7], 1, room=4302))  # a TP 1 decode naming two ranks
    delivered(prefill.role.link.channel.endpoint, transfer_request(4302, peer=decode.role.link.description,
                                                         rank_targets=[["127.0.0.1:1", 4096], ["127.0.0.1:2", 8192]]))
    finish = run([prefill])[(0, "bad-targets")]["finish"]
    assert "decode peer refused: the decode runs 1 ranks but lists 2 transfer targets" in finish["message"]
    prefill.add_request(pd_req("mixed-tp-staging", [5, 6, 7], 1, room=4303))  # staging under another TP size
    description = decode.role.link.description
    tp2 = {**description, "tp_size": 2, "kv_layout": {**description["kv_layout"], "num_kv_heads": 1}}
    delivered(prefill.role.link.channel.endpoint, transfer_request(
        4303, peer=tp2, staging_offered=True, rank_targets=[["127.0.0.1:1", 4096], ["127.0.0.1:2", 8192]]))
    finish = run([prefill])[(0, "mixed-tp-staging")]["finish"]
    assert "decode peer refused: receive staging takes whole tokens" in finish["message"]
    serves_a_pd_request(open_pair, "after-bad-peers", room=4301)


def test_early_claims_and_aborts_for_unknown_rooms_stay_bounded(open_pair):
    prefill, _, _ = open_pair
    pool_pages = prefill.runner.pool.layout.num_pages
    delivered(prefill.role.link.channel.endpoint, *(transfer_request(room, dst_pages=list(range(1, 201)))
                                          for room in range(10_000, 12_000)))
    delivered(prefill.role.link.channel.endpoint,
              *({"type": "abort", "room": room, "error": "x", "status": 400} for room in range(20_000, 22_000)),
              {"type": "abort", "room": 9_999})  # an older decode's: no status
    prefill.role.prepare_step()
    assert 0 < len(prefill.role.early_requests) <= MAX_EARLY_REQUESTS
    assert prefill.role.early_requests.pages <= pool_pages and len(prefill.role.early_requests) <= pool_pages // 200
    aborts = prefill.role.early_requests.aborts
    assert len(aborts) == MAX_EARLY_REQUESTS and aborts.take(20_000) is None  # the oldest made room
    assert aborts.take(9_999) == Abort(9_999) and aborts.take(21_999) == Abort(21_999, "x", status=400)
    serves_a_pd_request(open_pair, "after-flood", room=4002)


def test_a_peer_without_the_secret_is_refused_everywhere(secret_pair):
    prefill, decode, port = secret_pair
    forged = ClusterAuth("not-the-secret")
    assert "not signed" in refused(decode.role.link.channel.endpoint, kv_done(9))[0]
    assert "bad cluster-secret MAC" in refused(prefill.role.link.channel.endpoint, transfer_request(9), auth=forged)[0]
    assert "bad cluster-secret MAC" in refused(prefill.role.link.channel.endpoint, {"type": "abort", "room": 9},
                                               auth=forged)[0]
    # a KV write into the decode's pool: refused before any byte is copied
    target = decode.role.link.region.page_ptr(0, 0, 1)
    before = decode.runner.pool.buffer.clone()
    for auth in (None, forged):
        client = ControlClient(decode.role.link.engine.session_id(), timeout_s=10.0, auth=auth)
        client.send({"op": "write", "dst": [[target, 16]]}, [b"\x7f" * 16])
        with pytest.raises(TransferError, match="not signed|bad cluster-secret MAC"):
            client.recv("write ack")
        client.close()
    assert torch.equal(decode.runner.pool.buffer, before)
    # the route hijack: re-registering rank 0 with another control endpoint
    info = PrefillRankInfo(rank=0, control_endpoint="127.0.0.1:9", transfer_session="127.0.0.1:9",
                           transfer_backend="tcp", kv_layout=prefill.runner.pool.layout.describe(),
                           model=prefill.role.link.description["model"], tp_size=1)
    for auth in (None, forged):
        assert _request("PUT", f"http://127.0.0.1:{port}/route", asdict(info), 10.0, auth)[0] == 401
        assert _request("GET", f"http://127.0.0.1:{port}/route", None, 10.0, auth)[0] == 401
    assert _request("GET", f"http://127.0.0.1:{port}/health", None, 10.0)[0] == 200
    serves_a_pd_request(secret_pair, "signed", room=4003)  # the roles themselves sign everything


def test_a_replayed_signed_message_is_refused(secret_pair):
    prefill, _, _ = secret_pair
    auth = ClusterAuth(SECRET)
    signed = auth.sign({"type": "abort", "room": 12})
    client = ControlClient(prefill.role.link.channel.endpoint, timeout_s=10.0)
    try:
        client.send(signed)
        client.send(signed)
        with pytest.raises(TransferError, match="replayed"):
            client.recv("refusal")  # the first copy was accepted without a reply
    finally:
        client.close()


def test_damaged_kv_pages_fail_the_request_with_502_when_checksums_are_on(tiny_model, monkeypatch):
    """The write lands in the pages themselves (no receive staging), where the test damages it."""
    with running_pair(tiny_model, disaggregation_enable_kv_checksum=True, disaggregation_staging_mb=0) as (
            prefill, decode, port):
        prompt = list(range(20, 60))
        for s in (prefill, decode):
            s.add_request(pd_req("intact", prompt, port, room=501))
        outs = run([prefill, decode])
        assert outs[(1, "intact")]["finish"]["type"] == "length" and len(outs[(1, "intact")]["ids"]) == 8

        write_local = decode.role.link.engine._write_local

        def corrupt_after_write(targets):
            write_local(targets)
            _, block, _ = targets[-1]
            flat = decode.runner.pool.buffer.view(-1)
            flat[(block.dst - decode.role.link.region.base) // flat.element_size()] += 1.0

        monkeypatch.setattr(decode.role.link.engine, "_write_local", corrupt_after_write)
        for s in (prefill, decode):
            s.add_request(pd_req("damaged", prompt, port, room=502))
        outs = run([prefill, decode])
        finish = outs[(1, "damaged")]["finish"]
        assert finish["type"] == "abort" and finish["status_code"] == PEER_FAILED
        assert "KV checksum mismatch" in finish["message"] and outs[(1, "damaged")]["ids"] == []
        assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()


def test_checksummed_output_equals_colocated(tiny_model):
    with running_pair(tiny_model, disaggregation_enable_kv_checksum=True) as pair:
        check_pd_equals_colocated(tiny_model, pair, (3, 31, 70), seed=7, first_room=700)


def test_stale_and_forged_signatures_are_refused(monkeypatch):
    auth = ClusterAuth(SECRET)
    old = auth.sign({"type": "abort", "room": 1})
    token = auth.token("PUT", "/route", b"{}")
    auth.verify_token(token, "PUT", "/route", b"{}")
    with pytest.raises(AuthError, match="replayed"):
        auth.verify_token(token, "PUT", "/route", b"{}")
    with pytest.raises(AuthError, match="bad cluster-secret MAC"):
        auth.verify_token(auth.token("PUT", "/route", b"{}"), "PUT", "/route", b'{"rank": 0}')
    with pytest.raises(AuthError, match="bad cluster-secret MAC"):
        auth.verify({**old, "room": 2})
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 31)
    with pytest.raises(AuthError, match="outside the 30s window"):
        auth.verify(old)
