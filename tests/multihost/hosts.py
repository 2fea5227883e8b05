"""Where the multi-host tests' processes live: one PD cluster spread over three network-namespace hosts."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from cluster_util import CHILD_ENV, Proc, decode_server, prefill_server
from netns import Network

from pdserve.cluster_auth import SECRET_ENV

ROLES = ["prefill", "decode", "router"]
HTTP_PORT, BOOTSTRAP_PORT, ROUTER_PORT = 30000, 8998, 8000
CLUSTER_SECRET = "multihost-cluster-secret"
# a partitioned host is noticed within seconds: the router's unreachable-peer probe and health checks
ROUTER_ARGS = ["--health-check-interval-s", "0.5", "--health-check-timeout-s", "1", "--unreachable-timeout-s", "3",
               "--max-retries", "1"]


def mooncake_available() -> bool:
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class HostCluster:
    """One PD cluster spread over the three hosts; `bind` is what every role got as --host."""

    backend: str
    bind: str
    bootstrap_port: int
    prefill: Proc
    decode: Proc
    router: Proc

    @property
    def procs(self) -> list[Proc]:
        return [self.prefill, self.decode, self.router]


def host_cluster(net: Network, model: str, backend: str, wildcard: bool, offset: int) -> HostCluster:
    """The seeds' three commands, each in its own namespace; `offset` keeps clusters' ports apart."""
    hosts = net.hosts
    bind = {role: "0.0.0.0" if wildcard else hosts[role].address for role in ROLES}
    http, bootstrap = HTTP_PORT + offset, BOOTSTRAP_PORT + offset
    prefill = prefill_server(model, backend, bootstrap, "--host", bind["prefill"], "--port", str(http))
    decode = decode_server(model, backend, "--host", bind["decode"], "--port", str(http))
    prefill_url, decode_url = (f"http://{hosts[r].address}:{http}" for r in ("prefill", "decode"))
    router = Proc(f"router-{backend}", [sys.executable, "-m", "pdserve_router", "--host", bind["router"],
                                        "--port", str(ROUTER_PORT + offset), "--log-level", "warning",
                                        "--prefill", prefill_url, "--prefill-bootstrap-ports", str(bootstrap),
                                        "--decode", decode_url, *ROUTER_ARGS],
                  f"http://{hosts['router'].address}:{ROUTER_PORT + offset}", env=CHILD_ENV)
    for role, proc in zip(ROLES, (prefill, decode, router)):
        proc.argv = hosts[role].command(proc.argv)
        proc.env = {**CHILD_ENV, SECRET_ENV: CLUSTER_SECRET}  # a PD server other hosts reach refuses to run without
        port = ROUTER_PORT + offset if role == "router" else http
        proc.url = f"http://{hosts[role].address}:{port}"  # the test reaches it on its host's address
        proc.name = f"{proc.name}-{'wildcard' if wildcard else 'own'}"
    return HostCluster(backend, "0.0.0.0" if wildcard else "own address", bootstrap, prefill, decode, router)
