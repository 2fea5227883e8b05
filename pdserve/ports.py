"""Ports handed to child processes before they bind them: servers, routers, bootstrap servers, the
tensor-parallel group's rendezvous. A port picked now is bound only seconds later, by another process, so it is
picked where nothing else picks at random meanwhile."""

from __future__ import annotations

import functools
import os
import random
import socket
import time


class NoFreePort(RuntimeError):
    """Every candidate port is taken or was handed out already."""


LISTEN_PORTS_FIRST = 10000
# Ports a library in our children binds at random, without asking us: free now, taken by the time the child that
# was handed one binds it. The Mooncake transfer engine's handshake and TCP listeners pick from [15000, 17000]
# (its fallback when MC_MIN_RPC_PORT/MC_MAX_RPC_PORT are unset); a CI run lost a server to it.
PORTS_LIBRARIES_PICK = (range(15000, 17001),)
_ports_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is bindable now, that this process has not handed out before, and that lies below the kernel's
    ephemeral range and outside `PORTS_LIBRARIES_PICK`: a port chosen by `bind(0)` or by such a library can be
    taken by any outgoing connection (or another process's pick) in the time between this check and the child's
    own bind, which made servers fail with EADDRINUSE."""
    candidates = listen_port_candidates()
    if not candidates:
        return _bindable_port(host, 0)
    start = random.Random(os.getpid() ^ time.monotonic_ns()).randrange(len(candidates))
    for offset in range(len(candidates)):
        port = candidates[(start + offset) % len(candidates)]
        if port not in _ports_handed_out and _bindable_port(host, port):
            _ports_handed_out.add(port)
            return port
    raise NoFreePort(f"no free port on {host} in {candidates[0]}-{candidates[-1]}")


@functools.cache
def listen_port_candidates() -> tuple[int, ...]:
    """The ports `free_port` may hand out, ascending (worked out once a process)."""
    return tuple(port for port in range(LISTEN_PORTS_FIRST, _ephemeral_range()[0]) if not picked_by_a_library(port))


def picked_by_a_library(port: int) -> bool:
    return any(port in picked for picked in PORTS_LIBRARIES_PICK)


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable_port(host: str, port: int) -> int:
    """`port` (the one the kernel picked when 0) if `host:port` can be bound now; 0 if not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return 0
        return sock.getsockname()[1]
