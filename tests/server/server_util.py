"""Helpers for server tests: the real server as a subprocess on loopback, SSE and Prometheus parsing."""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import cluster_util
from cluster_util import http

API_KEY = "test-key"
CONTEXT_LENGTH = 256
MAX_BATCH_ITEMS = 8


class Reply(cluster_util.Reply):
    def events(self) -> list:
        """Parsed `data:` payloads of an SSE body; asserts it ends with `data: [DONE]`."""
        lines = [chunk for chunk in self.body.decode().split("\n\n") if chunk]
        assert lines and lines[-1] == "data: [DONE]", self.body[-200:]
        return super().events()


@dataclass
class ServerProcess(cluster_util.Proc):
    """The server under test: requests carry its API key, replies check the SSE `[DONE]`."""

    model_path: str = ""
    api_key: str | None = None

    def start(self) -> "ServerProcess":
        cluster_util.start_all([self])
        return self

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
        return cluster_util.descendants(self.proc.pid)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """`sig` to the server alone, and its exit code; its session is killed only if it outlives `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(10)
            raise


def api_server(model_path: str, log_path: Path, api_key: str | None = None) -> ServerProcess:
    """The server as the server tests configure it, logging to `log_path` (kept for the test to read)."""
    return cluster_util.server("server", model_path, "--max-total-tokens", "16384",
                               "--context-length", str(CONTEXT_LENGTH), "--max-batch-items", str(MAX_BATCH_ITEMS),
                               *(["--api-key", api_key] if api_key else []), kind=ServerProcess,
                               model_path=model_path, api_key=api_key, log_path=str(log_path))


def start_server(model_path: str, tmp_path_factory) -> ServerProcess:
    """The server tests' server, with the API key, started; its log in a new temporary folder."""
    return api_server(model_path, tmp_path_factory.mktemp("server") / "server.log", api_key=API_KEY).start()


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
