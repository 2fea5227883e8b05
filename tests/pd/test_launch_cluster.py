"""`python -m pdserve.launch_cluster` on CPU: it prints a line per server as it becomes healthy, then a working router
URL and curl line; when a child dies it names it, stops everything else and exits non-zero, leaving no process
behind; Ctrl-C stops it cleanly, with no "leaked semaphore" warning and no third-party INFO lines (mooncake's glog)
in its output or the servers' logs; a config error is one line on stderr before anything starts."""

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
from pd.conftest import mooncake_available

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
        for name in ("prefill 0", "decode 0", "router"):
            assert re.search(rf"^pdserve-cluster: {name} ready after \d+ s \(\d/\d\)$", output, re.M), output
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


GLOG_INFO_LINE = re.compile(r"^I\d{4} \d\d:\d\d:\d\d", re.M)


def test_ctrl_c_stops_cleanly_without_third_party_noise(tiny_model, tmp_path):
    backend = "mooncake" if mooncake_available() else "tcp"
    argv = [sys.executable, "-m", "pdserve.launch_cluster", "--model-path", tiny_model, "--device", "cpu",
            "--transfer-backend", backend, "--log-dir", str(tmp_path), "--", "--max-total-tokens", "4096"]
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=CHILD_ENV)
    try:
        for line in launcher.stdout:
            if line.startswith("Router: "):
                router_url = line.split()[1]
            if "Ctrl-C stops everything" in line:
                break
        reply = http("POST", router_url + "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 4}})
        assert reply.status == 200, reply.body
        launcher.send_signal(signal.SIGINT)
        stdout, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(30)
    assert launcher.returncode == 0, stderr
    assert "pdserve-cluster: stopping" in stdout
    logs = {path.name: path.read_text(errors="replace") for path in tmp_path.glob("*.log")}
    assert {"prefill-0.log", "decode-0.log", "router.log"} <= set(logs)
    for name, text in {"stderr": stderr, **logs}.items():
        assert "leaked semaphore" not in text, f"{name}:\n{text[-3000:]}"
        assert not GLOG_INFO_LINE.search(text), f"{name}:\n{text[-3000:]}"


@pytest.mark.parametrize("args, message", [
    (["--model-path", "/nonexistent/model"], "--model-path /nonexistent/model: no such directory"),
    (["--num-prefill", "x"], "argument --num-prefill: invalid int value: 'x'"),
    (["--device", "cpu", "--", "--page-size", "abc"], "after `--`: argument --page-size: invalid int value: 'abc'"),
    (["--device", "cpu", "--", "--mem-fraction-static", "3"], "after `--`: --mem-fraction-static must be in (0, 1)"),
])
def test_a_config_error_is_one_line(args, message, tmp_path):
    result = subprocess.run([sys.executable, "-m", "pdserve.launch_cluster", "--log-dir", str(tmp_path), *args],
                            capture_output=True, text=True, env=CHILD_ENV, timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"pdserve-cluster: error: {message}"), \
        result.stderr
    assert not list(tmp_path.iterdir())  # nothing started
