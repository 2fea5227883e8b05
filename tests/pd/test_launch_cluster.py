"""`python -m pdserve.launch_cluster` on CPU: it prints a line per server as it becomes healthy, then a working router
URL and curl line; when a child dies it names it, stops everything else and exits non-zero, leaving no process
behind; Ctrl-C stops it cleanly, with no "leaked semaphore" warning and no third-party INFO lines (mooncake's glog)
in its output or the servers' logs; a config error is one line on stderr before anything starts."""

from __future__ import annotations

import importlib.util
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
from cluster_util import mooncake_available

from pdserve import SamplingParams
from pdserve.cluster_auth import SECRET_ENV
from pdserve.launch_cluster import (Cluster, LaunchConfigError, Placement, PortPicker, parse_args, place_servers,
                                    plan_cluster, server_tp_sizes, structured_output_state)
from pdserve.server_processes import ClusterError

pytestmark = pytest.mark.timeout(900)  # two servers start inside the test


class Launched:
    """A `launch_cluster` process and the lines it printed (read on a thread)."""

    def __init__(self, argv: list[str]):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=CHILD_ENV)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if "Ctrl-C stops everything" in line:
                self.ready.set()
        self.ready.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float) -> None:
        assert self.ready.wait(timeout) and self.proc.poll() is None, self.output

    def url_of(self, child: str) -> str:
        return re.search(rf"^  {child}\s+(http://\S+)", self.output, re.M).group(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)


def launch_argv(model: str, log_dir, *flags: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.launch_cluster", "--model-path", model, "--device", "cpu",
            "--transfer-backend", "tcp", "--log-dir", str(log_dir), *flags, "--", "--max-total-tokens", "4096"]


def test_cluster_serves_and_stops_when_a_child_dies(tiny_model, tmp_path):
    launched = Launched(launch_argv(tiny_model, tmp_path))
    launcher, lines = launched.proc, launched.lines
    try:
        launched.wait_ready(400)
        output = launched.output
        for name in ("prefill 0", "decode 0", "router"):
            assert re.search(rf"^pdserve-cluster: {name} ready after \d+ s \(\d/\d\)$", output, re.M), output
        assert re.search(rf"^Model: {re.escape(tiny_model)}  ", output, re.M), output
        assert re.search(r"^Structured output: on \(xgrammar\)$", output, re.M), output
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
        launched.reader.join(10)
        output = launched.output
        assert "decode 0" in output and "exited with code -9" in output and "stopping everything" in output
        deadline = time.monotonic() + 15
        while any(live_session_members(sid) for sid in sessions):
            assert time.monotonic() < deadline, "children of the cluster outlived the launcher"
            time.sleep(0.2)
    finally:
        launched.stop()


def test_two_prefills_two_decodes_share_the_work_and_ctrl_c_stops_cleanly(tiny_model, tmp_path, offline_llm):
    """2P2D: output identical to the offline engine's (itself identical to colocated, test_pd_equivalence), and
    every prefill and every decode served requests. Then Ctrl-C stops it cleanly, with no "leaked semaphore" warning
    and no third-party INFO lines (mooncake's glog, where mooncake imports) in its output or the servers' logs (one
    cluster for both checks: a launch costs seconds of CPU per server)."""
    backend = "mooncake" if mooncake_available() else "tcp"
    argv = launch_argv(tiny_model, tmp_path, "--prefill", "2", "--decode", "2", "--router-args",
                       "--prefill-policy round_robin --decode-policy round_robin")
    argv[argv.index("--transfer-backend") + 1] = backend
    launched = Launched(argv)
    try:
        launched.wait_ready(600)
        router_url = re.search(r"^Router: (http://\S+)$", launched.output, re.M).group(1)
        prompts = ["The capital of France is", "1, 2, 3,", "Once upon a time", "Hello world"]
        greedy = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
        expected = offline_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                        use_tqdm=False)
        for prompt, offline in zip(prompts, expected):
            reply = http("POST", router_url + "/generate", {"text": prompt, "sampling_params": greedy})
            assert reply.status == 200, reply.body
            assert reply.json()["output_ids"] == offline.token_ids
        for child in ("prefill 0", "prefill 1", "decode 0", "decode 1"):
            metrics = http("GET", launched.url_of(child) + "/metrics").body.decode()
            received = re.search(r"^pdserve_requests_received_total (\S+)$", metrics, re.M).group(1)
            assert float(received) == 2, f"{child} received {received} requests"
        launched.proc.send_signal(signal.SIGINT)
        launched.proc.wait(120)
        launched.reader.join(10)
    finally:
        launched.stop()
    output = launched.output  # stdout and stderr
    assert launched.proc.returncode == 0, output
    assert "pdserve-cluster: stopping" in output
    logs = {path.name: path.read_text(errors="replace") for path in tmp_path.glob("*.log")}
    assert {"prefill-0.log", "prefill-1.log", "decode-0.log", "decode-1.log", "router.log"} <= set(logs)
    for name, text in {"output": output, **logs}.items():
        assert "leaked semaphore" not in text, f"{name}:\n{text[-3000:]}"
        assert not GLOG_INFO_LINE.search(text), f"{name}:\n{text[-3000:]}"


def test_servers_are_placed_on_gpus_in_order():
    """--prefill N --decode M on GPUs: prefill i on GPU i, decode j on GPU N+j, one router in front of all."""
    ns, engine_args = parse_args(["--prefill", "3", "--decode", "2", "--", "--page-size", "16"])
    servers, router = plan_cluster(ns, "/models/m", on_gpus(ns, 8), engine_args, PortPicker("127.0.0.1"))
    assert [(s.name, s.gpu) for s in servers] == [("prefill 0", 0), ("prefill 1", 1), ("prefill 2", 2),
                                                  ("decode 0", 3), ("decode 1", 4)]
    for spec in servers:
        assert spec.argv[spec.argv.index("--base-gpu-id") + 1] == str(spec.gpu)
    assert router.argv.count("--prefill") == 1 and all(s.url in router.argv for s in servers)
    prefill_args = router.argv[router.argv.index("--prefill") + 1:router.argv.index("--prefill-bootstrap-ports")]
    assert list(prefill_args) == [s.url for s in servers[:3]]


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


@pytest.mark.parametrize("args, message", [
    (["--model-path", "/nonexistent/model"], "--model-path: model path '/nonexistent/model' is neither a folder nor a hub id"),
    (["--num-prefill", "x"], "argument --num-prefill/--prefill: invalid int value: 'x'"),
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


def test_tensor_parallel_servers_take_a_block_of_gpus_and_a_rendezvous_port_each():
    """--prefill-tp-size / --decode-tp-size (default: --tp-size after `--`): each server gets its TP size, as many
    GPUs as ranks from the next free one on, and its own --nccl-port."""
    ns, engine_args = parse_args(["--prefill", "2", "--decode", "2", "--prefill-tp-size", "2", "--", "--tp-size", "1"])
    servers, _ = plan_cluster(ns, "/models/m", on_gpus(ns, 6), engine_args, PortPicker("127.0.0.1"))
    assert [(s.name, s.gpu, flag(s, "--tp-size")) for s in servers] == [
        ("prefill 0", 0, "2"), ("prefill 1", 2, "2"), ("decode 0", 4, "1"), ("decode 1", 5, "1")]
    rendezvous = [flag(s, "--nccl-port") for s in servers]
    assert rendezvous[2:] == [None, None] and None not in rendezvous[:2] and len(set(rendezvous[:2])) == 2
    ns, _ = parse_args(["--decode-tp-size", "1", "--", "--tp-size", "2"])
    assert (ns.prefill_tp_size, ns.decode_tp_size) == (2, 1)
    with pytest.raises(LaunchConfigError, match="--nccl-port after `--`"):
        parse_args(["--", "--nccl-port", "1234"])
    with pytest.raises(LaunchConfigError, match="--decode-tp-size must be at least 1"):
        parse_args(["--decode-tp-size", "0"])


def on_gpus(ns, gpus: int) -> Placement:
    return place_servers("auto", gpus, server_tp_sizes(ns), ns.engine)


def flag(spec, name):  # the value a server parses: the last one given
    values = [spec.argv[i + 1] for i, arg in enumerate(spec.argv) if arg == name]
    return values[-1] if values else None


@pytest.mark.parametrize("gpus, device, first_gpus", [
    (0, "cpu", (None, None)), (2, "cuda", (0, 1)), (4, "cuda", (0, 1)),
])
def test_placement_without_sharing_is_one_gpu_per_server_in_order_or_the_cpu(gpus, device, first_gpus):
    ns, _ = parse_args([])
    placement = on_gpus(ns, gpus)
    assert placement == Placement(device, first_gpus, ((), ()))


def test_one_gpu_is_shared_by_the_prefill_and_the_decode_with_cumulative_memory_fractions():
    ns, engine_args = parse_args(["--", "--page-size", "16"])
    placement = on_gpus(ns, 1)
    assert placement.device == "cuda" and placement.first_gpus == (0, 0) and placement.one_by_one
    assert placement.memory_flags == (("--mem-fraction-static", "0.400"), ("--mem-fraction-static", "0.800"))
    assert placement.note == ("one GPU: 2 servers share GPU 0, started one after another with --mem-fraction-static "
                              "0.400, 0.800 (each counts the memory of those before it)")
    servers, _ = plan_cluster(ns, "/models/m", placement, engine_args, PortPicker("127.0.0.1"))
    assert [(s.name, s.gpu, flag(s, "--base-gpu-id"), flag(s, "--mem-fraction-static")) for s in servers] == [
        ("prefill 0", 0, "0", "0.400"), ("decode 0", 0, "0", "0.800")]


def test_one_gpu_split_follows_the_given_fraction_or_max_total_tokens():
    ns, engine_args = parse_args(["--prefill", "2", "--decode", "2", "--", "--mem-fraction-static", "0.95"])
    fractions = [flags[1] for flags in on_gpus(ns, 1).memory_flags]
    assert fractions == ["0.200", "0.400", "0.600", "0.800"]
    servers, _ = plan_cluster(ns, "/models/m", on_gpus(ns, 1), engine_args, PortPicker("127.0.0.1"))
    assert [flag(s, "--mem-fraction-static") for s in servers] == fractions  # the split wins over the given one
    ns, _ = parse_args(["--", "--max-total-tokens", "120000"])
    placement = on_gpus(ns, 1)
    assert placement.memory_flags == ((), ()) and not placement.one_by_one and placement.first_gpus == (0, 0)
    assert "each with the --max-total-tokens 120000 given after `--`" in placement.note


def test_placements_that_cannot_work_are_refused():
    ns, _ = parse_args(["--prefill-tp-size", "2"])
    with pytest.raises(ClusterError, match="the servers need 3 GPUs .* but 1 are visible"):
        on_gpus(ns, 1)
    ns, _ = parse_args(["--prefill", "2"])
    with pytest.raises(ClusterError, match="the servers need 3 GPUs .* but 2 are visible"):
        on_gpus(ns, 2)
    with pytest.raises(ClusterError, match="no CUDA device is visible"):
        place_servers("cuda", 0, server_tp_sizes(ns), ns.engine)
    assert place_servers("cpu", 4, server_tp_sizes(ns), ns.engine).device == "cpu"
    ns, _ = parse_args(["--prefill", "9", "--decode", "9"])
    with pytest.raises(ClusterError, match="18 servers cannot share one GPU"):
        on_gpus(ns, 1)


def test_the_cluster_secret_is_the_given_one_or_generated(monkeypatch, tmp_path):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    generated = [parse_args([])[0].cluster_secret for _ in range(2)]
    assert len(generated[0]) >= 40 and generated[0] != generated[1]
    assert parse_args(["--", "--disaggregation-secret", "given"])[0].cluster_secret == "given"
    assert parse_args(["--", "--api-key", "key"])[0].cluster_secret == "key"
    monkeypatch.setenv(SECRET_ENV, "from-env")
    ns = parse_args([])[0]
    assert Cluster(str(tmp_path), 1.0, ns.cluster_secret).env[SECRET_ENV] == "from-env"  # every child's environment


def test_the_banner_says_why_structured_output_is_off(monkeypatch):
    engine = parse_args(["--", "--grammar-backend", "none"])[0].engine
    assert structured_output_state(engine) == "off (--grammar-backend none)"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert structured_output_state(parse_args([])[0].engine).startswith("off (xgrammar is not installed")
