"""A server killed with kill -9 leaves nothing behind and restarts on its ports at once."""

from __future__ import annotations

import http.client
import os
import signal
import time

from cluster_util import descendants, free_port, prefill_server, process_info, start_all

CHILDREN_GONE_SECONDS = 3.0


def open_keepalive(port: int) -> http.client.HTTPConnection:
    """A kept-alive connection: when the server dies first, its side of it lingers in TIME_WAIT."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/health")
    conn.getresponse().read()
    return conn


def server_roles(pids: list[int]) -> list[int]:
    """The scheduler and detokenizer (multiprocessing's resource tracker exits by itself when its pipe closes)."""
    def cmdline(pid: int) -> bytes:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    return [pid for pid in pids if b"resource_tracker" not in cmdline(pid)]


def test_killed_prefill_takes_its_frozen_children_and_restarts_on_its_ports(tiny_model):
    bootstrap = free_port()
    prefill = prefill_server(tiny_model, "tcp", bootstrap)
    port = int(prefill.url.rsplit(":", 1)[1])
    start_all([prefill])
    try:
        children = descendants(prefill.proc.pid)
        assert children
        conns = [open_keepalive(port), open_keepalive(bootstrap)]
        for pid in server_roles(children):  # frozen, as if stuck in native code: no thread of theirs can notice
            os.kill(pid, signal.SIGSTOP)
        prefill.proc.send_signal(signal.SIGKILL)
        prefill.proc.wait(10)
        deadline = time.monotonic() + CHILDREN_GONE_SECONDS
        while any(process_info(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in children if process_info(pid)], "children outlived the killed server"
        for conn in conns:
            conn.close()
        start_all([prefill])
        assert prefill.get("/health").status == 200
        assert "Address already in use" not in prefill.log()
    finally:
        prefill.stop()
