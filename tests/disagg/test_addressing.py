"""What a PD server announces to its peers for the address it binds, and mooncake's listeners kept to --host."""

from __future__ import annotations

import socket

import pytest

from pdserve.config import ConfigError, ServerArgs
from pdserve.disagg.addressing import (announced_endpoint, announced_host, host_address, join_endpoint,
                                       reachable_endpoint, registered_endpoint, split_endpoint)
from pdserve.disagg.transfer.listen_filter import listening_fds, restrict_new_listeners


def test_endpoints_split_and_join_with_ipv6_brackets():
    assert split_endpoint("10.0.0.2:8998") == ("10.0.0.2", 8998)
    assert split_endpoint("[fd00::2]:8998") == ("fd00::2", 8998)
    assert join_endpoint("fd00::2", 5) == "[fd00::2]:5"
    with pytest.raises(ValueError):
        split_endpoint("10.0.0.2")


def test_announced_host_prefers_advertise_then_bound_address_then_the_route_to_the_peer():
    assert announced_host("0.0.0.0", "203.0.113.7", "127.0.0.1") == "203.0.113.7"
    assert announced_host("10.0.0.5", None, "127.0.0.1") == "10.0.0.5"
    assert announced_host("0.0.0.0", None, "127.0.0.1") == "127.0.0.1"  # the kernel's source toward the peer
    assert announced_host("0.0.0.0", None) == host_address() != "0.0.0.0"
    assert announced_endpoint("0.0.0.0:4000", None, "127.0.0.1") == "127.0.0.1:4000"


def test_wildcard_registrations_are_resolved_per_lookup():
    assert registered_endpoint("0.0.0.0:4000", None) == "0.0.0.0:4000"
    assert registered_endpoint("0.0.0.0:4000", "203.0.113.7") == "203.0.113.7:4000"
    assert reachable_endpoint("0.0.0.0:4000", "::ffff:10.0.0.2") == "10.0.0.2:4000"
    assert reachable_endpoint("10.0.0.9:4000", "10.0.0.2") == "10.0.0.9:4000"


def test_advertise_host_must_be_an_address():
    with pytest.raises(ConfigError, match="advertise-host"):
        ServerArgs(model_path="m", disaggregation_advertise_host="0.0.0.0")


def connects(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize("family, wildcard", [(socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")])
def test_filtered_wildcard_listener_accepts_only_its_address(family, wildcard):
    """127.0.0.2 reaches this host over loopback too, yet a listener kept to 127.0.0.1 never sees it."""
    before = listening_fds()
    with socket.socket(family) as listener:
        if family == socket.AF_INET6:
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # dual stack, as mooncake's
        listener.bind((wildcard, 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert connects("127.0.0.2", port)
        assert restrict_new_listeners(before, "127.0.0.1") == [port]
        assert connects("127.0.0.1", port)
        assert not connects("127.0.0.2", port)


def test_mooncake_with_loopback_host_refuses_other_addresses():
    mooncake = pytest.importorskip("mooncake.engine", reason="pip install mooncake-transfer-engine-non-cuda")
    del mooncake
    from pdserve.disagg.transfer.mooncake import MooncakeTransferEngine

    before = listening_fds()
    engine = MooncakeTransferEngine("127.0.0.1", "cpu")
    try:
        ports = sorted({port for fd, (_, port) in listening_fds().items() if fd not in before})
        assert ports and int(engine.session_id().rsplit(":", 1)[1]) in ports
        for port in ports:
            assert connects("127.0.0.1", port) and not connects("127.0.0.2", port)
    finally:
        engine.close()


def test_control_socket_bound_to_ipv6_wildcard_is_reached_at_its_announced_endpoint():
    from pdserve.disagg.control_transport import ControlClient, ControlServer

    server = ControlServer("::", 0, lambda header, frames, reply: reply({"ok": True, "echo": header["n"]}), "test")
    client = ControlClient(announced_endpoint(server.endpoint, None, "127.0.0.1"), timeout_s=5)
    try:
        client.send({"n": 7})
        assert client.recv("echo")["echo"] == 7
    finally:
        client.close()
        server.close()
