"""Fixtures for router tests: in-process stub servers and the router as a real subprocess on loopback."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
from cluster_util import Reply, free_port, http

from tools.stub import StubHost


class RouterProcess:
    def __init__(self, args: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pdserve_router", "--port", str(self.port), "--health-check-interval-s", "0.1",
               "--retry-backoff-s", "0.001", *args]
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited early:\n{self.close()}")
            try:
                http("GET", self.url + "/workers", timeout=1)  # any answer (401 with --api-key) means it is up
                return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("router did not come up")

    def get(self, path: str, **kw) -> Reply:
        return http("GET", self.url + path, **kw)

    def post(self, path: str, body=None, **kw) -> Reply:
        return http("POST", self.url + path, body, **kw)

    def delete(self, path: str, body=None, **kw) -> Reply:
        return http("DELETE", self.url + path, body, **kw)

    def workers(self) -> dict[str, dict]:
        return {w["url"]: w for w in self.get("/workers").json()["workers"]}

    def metric(self, name: str) -> float:
        lines = self.get("/metrics").body.decode().splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))

    def wait_for(self, predicate, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"condition not met; workers: {self.workers()}")
            time.sleep(0.05)

    def close(self) -> str:
        """Stops the router and returns its log (printed, so that pytest shows it for a failed test)."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.seek(0)
        out = self.log.read()
        self.log.close()
        print(out)
        return out


@pytest.fixture
def stubs() -> Iterator[StubHost]:
    host = StubHost()
    yield host
    host.close()


@pytest.fixture
def start_router() -> Iterator:
    routers: list[RouterProcess] = []

    def start(*args: str) -> RouterProcess:
        routers.append(RouterProcess(list(args)))
        return routers[-1]

    yield start
    for router in routers:
        router.close()
