"""Helpers for server tests: the real server as a subprocess on loopback, SSE and Prometheus parsing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import cluster_util
from cluster_util import free_port, http

API_KEY = "test-key"
CONTEXT_LENGTH = 256
MAX_BATCH_ITEMS = 8
STARTUP_TIMEOUT = 300.0  # generous: a loaded 2-core machine imports torch slowly


class Reply(cluster_util.Reply):
    def events(self) -> list:
        """Parsed `data:` payloads of an SSE body; asserts it ends with `data: [DONE]`."""
        lines = [chunk for chunk in self.body.decode().split("\n\n") if chunk]
        assert lines and lines[-1] == "data: [DONE]", self.body[-200:]
        return super().events()


@dataclass
class ServerProcess:
    model_path: str
    extra_args: list[str] = field(default_factory=list)
    api_key: str | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    log_path: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ServerProcess":
        command = [sys.executable, "-m", "pdserve.launch_server", "--model-path", self.model_path,
                   "--port", str(self.port), "--device", "cpu", "--max-total-tokens", "16384",
                   "--context-length", str(CONTEXT_LENGTH), "--max-batch-items", str(MAX_BATCH_ITEMS),
                   *(["--api-key", self.api_key] if self.api_key else []), *self.extra_args]
        fd, self.log_path = tempfile.mkstemp(prefix="pdserve-test-", suffix=".log")
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited early:\n{self.log()}"
            try:
                if self.request("GET", "/health").status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise AssertionError(f"server not ready after {STARTUP_TIMEOUT} s:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def headers(self, auth: bool = True) -> dict:
        headers = {"Content-Type": "application/json"}
        if auth and self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def request(self, method: str, path: str, body: dict | bytes | None = None, auth: bool = True,
                timeout: float = 60.0) -> Reply:
        reply = http(method, self.url + path, body, headers=self.headers(auth), timeout=timeout)
        return Reply(reply.status, reply.body, reply.headers)

    def post(self, path: str, body: dict | bytes, **kwargs) -> Reply:
        return self.request("POST", path, body, **kwargs)

    def get(self, path: str, **kwargs) -> Reply:
        return self.request("GET", path, **kwargs)

    def descendants(self) -> list[int]:
        return descendants(self.proc.pid)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for pid in [*self.descendants(), self.proc.pid]:
                _kill(pid)
            self.proc.wait(10)
            raise


def descendants(pid: int) -> list[int]:
    """Live (not zombie) processes below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = process_info(int(entry))
            if info is not None:
                children.setdefault(info[1], []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def process_info(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a live process; None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] in ("Z", "X") else (fields[0], int(fields[1]))


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def parse_prometheus(text: str) -> dict[str, float]:
    """A strict reading of the text format: every sample belongs to a declared metric family."""
    samples, families = {}, set()
    for line in text.strip().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert kind in ("counter", "gauge", "histogram")
            families.add(name)
        elif not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            name = key.split("{")[0]
            assert any(name == f or name in (f + "_bucket", f + "_sum", f + "_count") for f in families), line
            samples[key] = float(value)
    return samples
