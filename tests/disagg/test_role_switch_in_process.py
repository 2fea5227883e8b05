"""`pdserve/role_switch.py` in one process over the tcp backend: a decode scheduler becomes a prefill on the same
runner and peer link, opens its bootstrap server, and a decode peer that cached its route while it was a prefill
hands off through it again after a switch to decode and back; a role that cannot start (its port taken, its warm-up
failing) leaves the old one serving."""

from __future__ import annotations

import socket

import pytest
from cluster_util import NO_MOONCAKE, free_port, mooncake_available
from test_pd_schedulers import engine_args, greedy, pd_req, run

from pdserve.config import ServerArgs
from pdserve.disagg.factory import create_scheduler
from pdserve import role_switch
from pdserve.role_switch import switch_role
from pdserve.scheduler.request import Req


def port_open(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(2)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def handoff_equals_colocated(prefill, decode, port: int, room: int, expected: list[int], prompt: list[int]) -> None:
    for sched in (prefill, decode):
        sched.add_request(pd_req(f"r{room}", prompt, port, room))
    assert run([prefill, decode])[(1, f"r{room}")]["ids"] == expected
    assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()


@pytest.mark.parametrize("backend", ["tcp", pytest.param("mooncake", marks=pytest.mark.skipif(
    not mooncake_available(), reason=NO_MOONCAKE))])
def test_a_decode_becomes_a_prefill_and_back_on_the_same_runner_and_link(tiny_model, backend):
    boot, pd_args = free_port(), engine_args(tiny_model, disaggregation_transfer_backend=backend)
    args = ServerArgs(disaggregation_mode="decode", disaggregation_bootstrap_port=boot, port=1,
                      enable_pd_role_switch=True, skip_server_warmup=True, **pd_args)
    moving = create_scheduler(args)
    peer = create_scheduler(ServerArgs(disaggregation_mode="decode", port=2, **pd_args))
    colocated = create_scheduler(ServerArgs(**engine_args(tiny_model, disaggregation_transfer_backend="auto")))
    prompt = [(i * 13 + 5) % 900 + 3 for i in range(45)]
    colocated.add_request(Req(rid="c", input_ids=prompt, sampling_params=greedy()))
    expected = run([colocated])[(0, "c")]["ids"]
    runner, link = moving.runner, moving.role.link
    try:
        assert not port_open(boot)
        assert switch_role(moving, args, "decode") == (moving, "cannot switch from decode to 'decode': the roles "
                                                                "are prefill, decode")
        moving, error = switch_role(moving, args, "prefill")
        assert error is None and moving.runner is runner and moving.role.link is link and port_open(boot)
        assert moving.model_info["disaggregation_mode"] == "prefill" and link.args.disaggregation_mode == "prefill"
        handoff_equals_colocated(moving, peer, boot, 1, expected, prompt)
        route = peer.role.routes.get(f"127.0.0.1:{boot}")  # the peer caches the route to the prefill
        moving, error = switch_role(moving, args, "decode")
        assert error is None and not port_open(boot) and moving.role.link is link
        moving, error = switch_role(moving, args, "prefill")
        assert error is None and port_open(boot)
        handoff_equals_colocated(moving, peer, boot, 2, expected, prompt)
        assert peer.role.routes.get(f"127.0.0.1:{boot}") is route  # served through the route cached before the switches
        moving, _ = switch_role(moving, args, "decode")
    finally:
        moving.close()
        peer.close()


def test_a_prefill_role_that_cannot_open_its_bootstrap_port_leaves_the_decode_role(tiny_model):
    boot = free_port()
    args = ServerArgs(disaggregation_mode="decode", disaggregation_bootstrap_port=boot, port=1,
                      enable_pd_role_switch=True, skip_server_warmup=True, **engine_args(tiny_model))
    moving = create_scheduler(args)
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", boot))
            taken.listen()
            moving, error = switch_role(moving, args, "prefill")
        assert error is not None and error.startswith("BootstrapError")
        assert moving.args.disaggregation_mode == "decode" and moving.kv_pool_is_fully_free()
        moving.add_request(Req(rid="local", input_ids=[5, 6, 7, 8], sampling_params=greedy()))
        assert len(run([moving])[(0, "local")]["ids"]) == 8  # a decode serving its own prompt again
    finally:
        moving.close()


def test_a_new_role_whose_warm_up_fails_closes_and_the_old_role_serves(tiny_model, monkeypatch):
    boot = free_port()
    args = ServerArgs(disaggregation_mode="decode", disaggregation_bootstrap_port=boot, port=1,
                      enable_pd_role_switch=True, **engine_args(tiny_model))
    moving = create_scheduler(args)
    real_warm_up = role_switch.warm_up

    def warm_up_failing_as_prefill(scheduler):
        if scheduler.args.disaggregation_mode == "prefill":
            raise RuntimeError("CUDA out of memory (a test's)")
        return real_warm_up(scheduler)

    monkeypatch.setattr(role_switch, "warm_up", warm_up_failing_as_prefill)
    try:
        moving, error = switch_role(moving, args, "prefill")
        assert error == "RuntimeError: CUDA out of memory (a test's)"
        assert moving.args.disaggregation_mode == "decode" and not port_open(boot)  # the prefill's port closed
        moving.add_request(Req(rid="local", input_ids=[5, 6, 7, 8], sampling_params=greedy()))
        assert len(run([moving])[(0, "local")]["ids"]) == 8
    finally:
        moving.close()
