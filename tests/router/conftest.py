"""Fixtures for router tests: in-process stub servers and the router as a real subprocess on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from cluster_util import Proc, Reply, free_port, http

from pdserve.server_processes import router_argv, start_all

from tools.stub import StubHost

ROUTER_STARTUP_TIMEOUT_S = 15.0


class RouterProcess(Proc):
    """The router under test; it is up when /workers answers (with no healthy instance /health says 503)."""

    def healthy(self) -> bool:
        self.check_alive()
        try:
            http("GET", self.url + "/workers", timeout=1)  # any answer (401 with --api-key) means it is up
            return True
        except OSError:
            return False

    @classmethod
    def start(cls, args: list[str]) -> "RouterProcess":
        port = free_port()
        argv = router_argv(port, "--health-check-interval-s", "0.1", "--retry-backoff-s", "0.001", *args)
        router = cls("router", argv, f"http://127.0.0.1:{port}")
        start_all([router], ROUTER_STARTUP_TIMEOUT_S)
        return router

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
        out = self.log()
        self.stop(timeout=10)
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
        routers.append(RouterProcess.start(list(args)))
        return routers[-1]

    yield start
    for router in routers:
        router.close()
