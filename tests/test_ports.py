"""The ports the launchers and tests hand their children never lie where a library in those children picks its own
listeners at random: such a port, free when handed out, could be taken before the child binds it (a CI run lost a
colocated server to a Mooncake listener of a prefill started beside it)."""

import os
import subprocess
import sys
import textwrap

import pytest

from pdserve import ports
from pdserve.ports import free_port, listen_port_candidates, picked_by_a_library
from cluster_util import mooncake_available

MOONCAKE_LISTENERS = textwrap.dedent("""
    from pdserve.disagg.transfer.listen_filter import listening_fds
    from pdserve.disagg.transfer.mooncake import MooncakeTransferEngine
    before = set(listening_fds().values())
    engines = [MooncakeTransferEngine("127.0.0.1") for _ in range(3)]
    print(" ".join(str(port) for _, port in set(listening_fds().values()) - before))
""")


def test_candidates_avoid_library_picks_and_the_ephemeral_range():
    candidates = listen_port_candidates()
    first_ephemeral = ports._ephemeral_range()[0]
    assert list(candidates) == sorted(candidates) and len(candidates) > 10000
    assert candidates[0] >= ports.LISTEN_PORTS_FIRST and candidates[-1] < first_ephemeral
    assert not [port for port in candidates if picked_by_a_library(port)]


def test_free_port_hands_out_candidates_only_once(monkeypatch):
    monkeypatch.setattr(ports, "_ports_handed_out", set())
    monkeypatch.setattr(ports, "listen_port_candidates", lambda: [15500, 16999, 17001, 17002])
    assert sorted(free_port() for _ in range(4)) == [15500, 16999, 17001, 17002]
    with pytest.raises(ports.NoFreePort, match="no free port"):
        free_port()


@pytest.mark.skipif(not mooncake_available(), reason="mooncake transfer engine not installed")
def test_mooncake_listeners_lie_in_the_range_left_to_it():
    out = subprocess.run([sys.executable, "-c", MOONCAKE_LISTENERS], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "MC_LOG_LEVEL": "ERROR"})
    assert out.returncode == 0, out.stderr[-2000:]
    listeners = [int(port) for port in out.stdout.split()]
    assert len(listeners) >= 6  # each engine's handshake and TCP transport listeners
    assert all(picked_by_a_library(port) for port in listeners), listeners
