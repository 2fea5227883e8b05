"""A private network of "hosts" on one Linux machine: one network namespace per host, each with one veth
into a bridge in the root namespace, addresses on a 10.77.N.0/24 subnet. Needs root (CI runs as root).

Every name starts with `pdn<pid>` of the pytest process that made it, so leftovers of a crashed run (whose pid
is gone) are found and removed by the next run, and runs at the same time never share a name or a subnet.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from dataclasses import dataclass, field

PREFIX = "pdn"
_OWNED = re.compile(rf"^{PREFIX}(\d+)")


class NetnsUnavailable(RuntimeError):
    """`ip netns` is refused here (not root, no iproute2, a sandbox without namespaces)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def netns_refusal() -> str | None:
    """Why network namespaces cannot be built here, or None when they can."""
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        made = ip("netns", "add", probe, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        return f"iproute2 is not usable: {exc}"
    if made.returncode != 0:
        return f"ip netns add is refused: {made.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_namespace(name: str) -> None:
    """Kill whatever still runs in the namespace, then delete it."""
    pids = ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    ip("netns", "del", name, check=False)


def clean_leftovers() -> None:
    """Namespaces and links of earlier runs whose pytest process is gone."""
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        owner = _OWNED.match(name)
        if owner and not _pid_alive(int(owner.group(1))):
            remove_namespace(name)
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        owner = _OWNED.match(name)
        if owner and not _pid_alive(int(owner.group(1))):
            ip("link", "del", name, check=False)


@dataclass
class Host:
    name: str  # network namespace
    address: str
    veth: str  # the root-namespace end, on the bridge: `ip link set <veth> down` partitions the host

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]


@dataclass
class Network:
    """A bridge with the root namespace at .1 (where the test runs) and one namespace per host from .2 up."""

    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    subnet: str = field(default_factory=lambda: f"10.77.{os.getpid() % 200 + 20}")
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def gateway(self) -> str:
        return f"{self.subnet}.1"

    def create(self, names: list[str]) -> "Network":
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for i, name in enumerate(names):
                self.hosts[name] = self._add_host(name, i)
        except BaseException:
            self.destroy()
            raise
        return self

    def _add_host(self, name: str, index: int) -> Host:
        host = Host(f"{self.tag}-{name}", f"{self.subnet}.{index + 2}", f"{self.tag}h{index}")
        inner = f"{self.tag}n{index}"
        ip("netns", "add", host.name)
        ip("link", "add", host.veth, "type", "veth", "peer", "name", inner)
        ip("link", "set", inner, "netns", host.name)
        ip("link", "set", host.veth, "master", self.bridge)
        ip("link", "set", host.veth, "up")
        inside = ["-n", host.name]
        ip(*inside, "link", "set", "lo", "up")
        ip(*inside, "addr", "add", f"{host.address}/24", "dev", inner)
        ip(*inside, "link", "set", inner, "up")
        return host

    def partition(self, name: str, down: bool) -> None:
        ip("link", "set", self.hosts[name].veth, "down" if down else "up")

    def destroy(self) -> None:
        for host in self.hosts.values():
            remove_namespace(host.name)  # its veth pair goes with it
            ip("link", "del", host.veth, check=False)
        ip("link", "del", self.bridge, check=False)
        self.hosts.clear()
