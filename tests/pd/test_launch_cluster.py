"""`python -m pdserve.launch_cluster` on CPU: it prints a working router URL and curl line, and when a child dies
it names it, stops everything else and exits non-zero, leaving no process behind."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest
from cluster_util import CHILD_ENV, http, live_session_members

pytestmark = pytest.mark.timeout(900)  # two servers start inside the test


def test_cluster_serves_and_stops_when_a_child_dies(tiny_model, tmp_path):
    argv = [sys.executable, "-m", "pdserve.launch_cluster", "--model-path", tiny_model, "--device", "cpu",
            "--transfer-backend", "tcp", "--log-dir", str(tmp_path), "--", "--max-total-tokens", "4096"]
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=CHILD_ENV)
    lines: list[str] = []
    ready = threading.Event()

    def read_output() -> None:
        for line in launcher.stdout:
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                ready.set()
        ready.set()

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    try:
        assert ready.wait(400) and launcher.poll() is None, "".join(lines)
        output = "".join(lines)
        router_url = re.search(r"^Router: (http://\S+)$", output, re.M).group(1)
        curl = shlex.split(next(line for line in lines if line.strip().startswith("curl ")))
        body = curl[curl.index("-d") + 1]
        reply = http("POST", router_url + "/generate", json.loads(body))
        assert reply.status == 200 and len(reply.json()["output_ids"]) > 0, reply.body
        decode_port = int(re.search(r"decode 0\s+http://127\.0\.0\.1:(\d+)", output).group(1))
        decode_pid = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _serves(int(p), decode_port))
        sessions = {os.getsid(pid) for pid in _children(launcher.pid)}  # each child leads its own session
        os.kill(decode_pid, signal.SIGKILL)
        assert launcher.wait(60) == 1
        reader.join(10)
        output = "".join(lines)
        assert "decode 0" in output and "exited with code -9" in output and "stopping everything" in output
        deadline = time.monotonic() + 15
        while any(live_session_members(sid) for sid in sessions):
            assert time.monotonic() < deadline, "children of the cluster outlived the launcher"
            time.sleep(0.2)
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(60)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _serves(pid: int, port: int) -> bool:
    """Whether `pid` runs `launch_server ... --port <port>` (the decode server's main process)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return False
    if b"pdserve.launch_server" not in args or b"--port" not in args:
        return False
    return args[args.index(b"--port") + 1] == str(port).encode()
