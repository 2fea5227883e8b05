"""Launch flags, start-up failures, and a crashing child taking the whole server down."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from cluster_util import still_alive
from server_util import api_server

from pdserve.config import ServerArgs

SEED_PREFILL_FLAGS = [
    "--model-path", "/data/public/model/qwen2.5/qwen2.5-7b-instruct", "--port", "7000", "--host", "0.0.0.0",
    "--tensor-parallel-size", "1", "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "8998",
    "--disaggregation-transfer-backend", "mooncake", "--disaggregation-ib-device", "mlx5_2",
    "--max-total-tokens", "4096", "--dtype", "float16", "--trust-remote-code",
]
SGLANG_FLAGS = [
    "--model-path", "m", "--tokenizer-path", "t", "--tp-size", "1", "--mem-fraction-static", "0.8",
    "--chunked-prefill-size", "4096", "--max-running-requests", "32", "--page-size", "16", "--context-length", "2048",
    "--served-model-name", "qwen", "--api-key", "k", "--log-level", "warning", "--device", "cpu", "--random-seed", "3",
]


def run_cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.launch_server", *argv], capture_output=True, text=True,
                          timeout=timeout)


def test_seed_commands_and_sglang_flags_parse():
    args = ServerArgs.from_cli(SEED_PREFILL_FLAGS)
    assert (args.port, args.host, args.disaggregation_mode, args.dtype) == (7000, "0.0.0.0", "prefill", "float16")
    args = ServerArgs.from_cli(SGLANG_FLAGS)
    assert (args.served_model_name, args.api_key, args.random_seed, args.context_length) == ("qwen", "k", 3, 2048)
    assert ServerArgs.from_cli(["--model-path", "m"]).host == "127.0.0.1"


def test_help_is_grouped():
    result = run_cli("--help")
    assert result.returncode == 0
    for group in ("model:", "memory:", "http:", "parallelism:", "disaggregation:"):
        assert group in result.stdout
    for flag in ("--tensor-parallel-size", "--served-model-name", "--api-key", "--disaggregation-bootstrap-port"):
        assert flag in result.stdout


@pytest.mark.parametrize("argv,message", [
    (["--tp-size", "0"], "--tp-size must be positive"),
    (["--page-size", "0"], "--page-size must be positive"),
    (["--disaggregation-mode", "prefill", "--port", "8998"], "give them different ports"),
    (["--mem-fraction-static", "1.5"], "--mem-fraction-static"),
    (["--port", "notaport"], "invalid int value"),
])
def test_invalid_flags_fail_at_start_with_a_clear_message(argv, message):
    result = run_cli("--model-path", "m", *argv)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_taken_port_fails_fast(tiny_model):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        started = time.monotonic()
        result = run_cli("--model-path", tiny_model, "--port", str(sock.getsockname()[1]), "--device", "cpu")
    assert result.returncode == 1 and "cannot listen on" in result.stderr
    assert time.monotonic() - started < 30


def test_context_length_past_the_model_positions_is_refused_at_start(tiny_model):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = run_cli("--model-path", tiny_model, "--port", str(port), "--device", "cpu", "--context-length", "5000",
                     timeout=180)
    assert result.returncode != 0
    refusals = [line for line in result.stderr.splitlines() if "--context-length 5000" in line]
    assert refusals and "max_position_embeddings (4096)" in refusals[0], result.stderr


def test_child_crash_takes_the_server_down(tiny_model, tmp_path):
    server = api_server(tiny_model, tmp_path / "server.log").start()
    try:
        children = server.descendants()
        victim = max(children, key=_rss_kb)  # the scheduler or the detokenizer, not the resource tracker
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        assert server.proc.wait(30) == 1
        assert time.monotonic() - killed_at < 20
        line = rf"the (scheduler|detokenizer) process \(pid {victim}\) exited with code -9; shutting down the server"
        assert re.search(line, server.log()), server.log()
        assert still_alive(children) == []
    finally:
        server.stop()


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
