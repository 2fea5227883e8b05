"""The ZeroMQ sockets between a server's processes: each process (tokenizer, scheduler, detokenizer) receives on one
ipc:// socket in the server's private directory and pushes to the others'."""

from __future__ import annotations

import os
from typing import Any

import zmq


def ipc_addr(args: Any, name: str) -> str:
    """Address of the socket that process `name` receives on: tokenizer, scheduler or detokenizer."""
    if not args.ipc_dir:
        raise ValueError("ServerArgs.ipc_dir is not set; the launcher sets it")
    return f"ipc://{os.path.join(args.ipc_dir, name)}"


def pull_socket(ctx: zmq.Context, addr: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    _configure(sock)
    sock.bind(addr) if bind else sock.connect(addr)
    return sock


def push_socket(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    _configure(sock)
    sock.connect(addr)
    return sock


def _configure(sock: zmq.Socket) -> None:
    # Unbounded queues: a full queue would block the scheduler loop; memory is bounded by requests in flight.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
