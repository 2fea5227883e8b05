"""Which address a PD server announces to a peer, for the address it binds (`--host`).

Every socket binds `--host`. An address handed to a peer must be one the peer can reach:
  * `--disaggregation-advertise-host` when set (NAT, several NICs: the operator knows best);
  * else `--host` itself when it names one address;
  * else (a wildcard such as 0.0.0.0) the local address of the interface that routes to the peer: the source
    address the kernel picks toward it (a UDP connect() sends no packet), or, where the peer is not known yet,
    the address toward the default route, then the first non-loopback interface address.
The prefill's bootstrap server answers each route lookup with the address the lookup arrived on in place of
a wildcard, so a decode server always gets an address it has just reached.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
_SIOCGIFADDR = 0x8915
_TEST_NET = "192.0.2.1"  # RFC 5737: never answers; only the default route toward it matters


def is_wildcard(host: str) -> bool:
    return host in WILDCARD_HOSTS


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """"host:port" or "[v6]:port" -> (host, port)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"endpoint {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


def join_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def source_address_toward(peer_host: str) -> str | None:
    """The local address the kernel would send from to reach `peer_host`; None without a route."""
    peer_host = peer_host.strip("[]")
    family = socket.AF_INET6 if ":" in peer_host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((peer_host, 9))
            return unmapped(sock.getsockname()[0])
    except OSError:
        return None


def interface_addresses() -> list[str]:
    """IPv4 addresses of this host's (network namespace's) interfaces, loopback excluded."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                ifreq = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            address = socket.inet_ntoa(ifreq[20:24])
            if not ipaddress.ip_address(address).is_loopback:
                found.append(address)
    return found


def host_address() -> str:
    """This host's address for a peer not known yet."""
    return source_address_toward(_TEST_NET) or next(iter(interface_addresses()), None) or "127.0.0.1"


def announced_host(bind_host: str, advertise_host: str | None, peer_host: str | None = None) -> str:
    """The address to tell a peer (at `peer_host`, when known) for a socket bound to `bind_host`."""
    if advertise_host:
        return advertise_host
    if not is_wildcard(bind_host):
        return bind_host
    return (source_address_toward(peer_host) if peer_host else None) or host_address()


def announced_endpoint(endpoint: str, advertise_host: str | None, peer_host: str | None = None) -> str:
    host, port = split_endpoint(endpoint)
    return join_endpoint(announced_host(host, advertise_host, peer_host), port)


def registered_endpoint(endpoint: str, advertise_host: str | None) -> str:
    """What a prefill registers with its bootstrap server: the advertised address, else the bound one (a wildcard
    is resolved per lookup by the bootstrap server, see `reachable_endpoint`)."""
    return join_endpoint(advertise_host, split_endpoint(endpoint)[1]) if advertise_host else endpoint


def reachable_endpoint(endpoint: str, local_address: str) -> str:
    """`endpoint` with a wildcard host replaced by `local_address`, the address a peer has just reached us at."""
    host, port = split_endpoint(endpoint)
    return join_endpoint(unmapped(local_address), port) if is_wildcard(host) else endpoint


def unmapped(address: str) -> str:
    """"::ffff:10.0.0.2" (an IPv4 peer on a dual-stack socket) -> "10.0.0.2"."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    return str(ip.ipv4_mapped) if ip.version == 6 and ip.ipv4_mapped else address
