"""Where the tensor-parallel ranks of one server meet (torch-free: the HTTP process picks the port)."""

from __future__ import annotations

import socket


def free_rendezvous_port() -> int:
    """A port on 127.0.0.1 free right now, for the ranks to meet on when --nccl-port is not given."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
