"""--unreachable-timeout-s: upstream connections give up on a peer that acknowledges nothing (keep-alive probes
included) after that long, and the flag is checked."""

from __future__ import annotations

import socket

import pytest

from pdserve_router.config import ConfigError, RouterConfig
from pdserve_router.upstream import watch_reachability


@pytest.mark.parametrize("timeout_s, idle, interval, count", [(3, 1, 1, 2), (30, 10, 5, 4)])
def test_keepalive_probes_fit_in_the_timeout(timeout_s, idle, interval, count):
    with socket.socket() as sock:
        watch_reachability(sock, timeout_s)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == idle
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == interval
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == count
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == timeout_s * 1000
        assert idle + interval * count <= timeout_s


def test_unreachable_timeout_below_one_second_is_refused():
    with pytest.raises(ConfigError, match="unreachable-timeout-s"):
        RouterConfig(unreachable_timeout_s=0.5)
