"""Keep a library's wildcard-bound listening sockets to one address.

Mooncake binds its handshake and TCP-transport listeners to INADDR_ANY whatever host it is given. On a server
started with a specific `--host` (127.0.0.1 by default), `restrict_new_listeners` attaches a kernel socket
filter (classic BPF, SO_ATTACH_FILTER) to every wildcard listener the library opened: a packet whose
destination is not that address is dropped before it reaches the socket, so no connection to the library can
be opened through any other interface. Accepted connections inherit the filter.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import struct

from pdserve.disagg.addressing import is_wildcard

_SO_ATTACH_FILTER = 26
_SKF_NET_OFF = -0x100000  # classic BPF: offsets from here address the network (IP) header
# classic BPF opcodes
_LD_W_ABS, _LD_B_ABS, _RSH_K, _JEQ_K, _RET_K = 0x20, 0x30, 0x74, 0x15, 0x06
_ACCEPT, _DROP = 0xFFFFFFFF, 0


def listening_fds() -> dict[int, tuple[str, int]]:
    """This process's listening TCP sockets: fd -> (bound address, port)."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM \
                        and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    found[fd] = sock.getsockname()[:2]
        except OSError:  # closed meanwhile, or not an inet socket
            continue
    return found


def destination_filter(host: str) -> bytes:
    """A classic BPF program that accepts a packet only when its destination address is `host`."""
    ip = ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0])
    words = struct.unpack(f"!{len(ip.packed) // 4}I", ip.packed)
    # IPv4: version 4 and the destination word at offset 16; IPv6: version 6 and four words from offset 24
    dst_offset, version = (16, 4) if ip.version == 4 else (24, 6)
    program = [(_LD_B_ABS, 0, 0, _SKF_NET_OFF), (_RSH_K, 0, 0, 4)]
    program.append((_JEQ_K, 0, 2 * len(words), version))  # another IP version: to the final drop
    for i, word in enumerate(words):
        program.append((_LD_W_ABS, 0, 0, _SKF_NET_OFF + dst_offset + 4 * i))
        remaining = 2 * (len(words) - i - 1)
        program.append((_JEQ_K, 0, remaining + 1, word))
    program += [(_RET_K, 0, 0, _ACCEPT), (_RET_K, 0, 0, _DROP)]
    return b"".join(struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF) for code, jt, jf, k in program)


def attach_filter(fd: int, program: bytes) -> None:
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("HxxxxxxQ", len(program) // 8, ctypes.addressof(buf))
    with socket.socket(fileno=os.dup(fd)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)


def restrict_new_listeners(before: dict[int, tuple[str, int]], host: str) -> list[int]:
    """Filter every wildcard listener opened since `before` (a `listening_fds()` snapshot) to `host`; returns
    their ports."""
    program = destination_filter(host)
    ports = []
    for fd, (address, port) in listening_fds().items():
        if before.get(fd) != (address, port) and is_wildcard(address):
            attach_filter(fd, program)
            ports.append(port)
    return ports
