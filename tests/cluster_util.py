"""Real pdserve servers and routers as subprocesses on loopback, for the PD and router end-to-end tests.

Start several processes at once (`start_all`): on a 2-core box the model loads overlap, so a cluster costs
about one server's start-up time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field

STARTUP_TIMEOUT = 480.0  # generous: CI boxes shared with other jobs start servers slowly
STOP_TIMEOUT = 30.0
CONTEXT_LENGTH = 512
MAX_TOTAL_TOKENS = 4096
# small PD timeouts so that failure tests end in seconds
PD_TIMEOUTS = ["--disaggregation-bootstrap-timeout", "6", "--disaggregation-waiting-timeout", "6",
               "--disaggregation-heartbeat-interval", "0.5", "--disaggregation-heartbeat-failures", "2"]
# one intra-op thread per process: several servers share a few cores, and oversubscription makes each token slower
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Reply:
    status: int
    body: bytes
    headers: dict = field(default_factory=dict)

    def json(self):
        return json.loads(self.body)

    def events(self) -> list:
        """The `data:` payloads of an SSE body, without the final `[DONE]`."""
        chunks = [c for c in self.body.decode().split("\n\n") if c.startswith("data: ")]
        return [json.loads(c[6:]) for c in chunks if c != "data: [DONE]"]


def http(method: str, url: str, body: dict | bytes | None = None, headers: dict | None = None,
         timeout: float = 60.0) -> Reply:
    """One request; a JSON body is encoded, bytes go as they are; an error status is a Reply, not an exception."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Reply(resp.status, resp.read(), dict(resp.headers))
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, exc.read(), dict(exc.headers))


@dataclass
class Proc:
    """One server or router process; its output goes to a log file that failures print."""

    name: str
    argv: list[str]
    port: int
    proc: subprocess.Popen | None = None
    log_path: str = ""
    host: str = "127.0.0.1"  # where the test reaches it

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def launch(self) -> "Proc":
        fd, self.log_path = tempfile.mkstemp(prefix=f"pdserve-{self.name}-", suffix=".log")
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env=CHILD_ENV)
        return self

    def healthy(self) -> bool:
        assert self.proc.poll() is None, f"{self.name} exited with {self.proc.returncode}:\n{self.log()}"
        try:
            return http("GET", self.url + "/health", timeout=2).status == 200
        except OSError:
            return False

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-6000:]

    def get(self, path: str, **kwargs) -> Reply:
        return http("GET", self.url + path, **kwargs)

    def post(self, path: str, body: dict, **kwargs) -> Reply:
        return http("POST", self.url + path, body, **kwargs)

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # the whole session: the server's scheduler and detokenizer too
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        """SIGTERM to the server process only, as a user would send; it stops its own children."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def stop(self) -> None:
        if self.proc is None:
            return
        self.terminate()
        try:
            self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pass
        self.signal(signal.SIGKILL)  # whatever is left of the session
        self.proc.wait(10)
        os.unlink(self.log_path)


def wait_healthy(procs: Iterable[Proc], timeout: float = STARTUP_TIMEOUT) -> None:
    pending = list(procs)
    deadline = time.monotonic() + timeout
    while pending:
        pending = [p for p in pending if not p.healthy()]
        if pending and time.monotonic() > deadline:
            raise AssertionError(f"not healthy after {timeout} s: {pending[0].name}\n{pending[0].log()}")
        time.sleep(0.25)


def start_all(procs: list[Proc]) -> list[Proc]:
    """Launch every process, then wait until all answer /health; on failure stop them all."""
    try:
        for proc in procs:
            proc.launch()
        wait_healthy(procs)
    except BaseException:
        stop_all(procs)
        raise
    return procs


def stop_all(procs: Iterable[Proc]) -> None:
    procs = [p for p in procs if p.proc is not None]
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.stop()


def server(name: str, model: str, *extra: str, port: int | None = None) -> Proc:
    port = port or free_port()
    argv = [sys.executable, "-m", "pdserve.launch_server", "--model-path", model, "--port", str(port),
            "--device", "cpu", "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--context-length", str(CONTEXT_LENGTH),
            *extra]
    return Proc(name, argv, port)


def prefill_server(model: str, backend: str, bootstrap_port: int, *extra: str, port: int | None = None) -> Proc:
    return server(f"prefill-{backend}", model, "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend",
                  backend, "--disaggregation-bootstrap-port", str(bootstrap_port), *PD_TIMEOUTS, *extra, port=port)


def decode_server(model: str, backend: str, *extra: str, name: str = "", port: int | None = None) -> Proc:
    return server(name or f"decode-{backend}", model, "--disaggregation-mode", "decode",
                  "--disaggregation-transfer-backend", backend, "--num-reserved-decode-tokens", "64",
                  *PD_TIMEOUTS, *extra, port=port)


def router(prefills: list[tuple[Proc, int]], decodes: list[Proc], *extra: str, name: str = "router") -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "pdserve_router", "--port", str(port), "--log-level", "warning",
            "--prefill", *(p.url for p, _ in prefills), "--prefill-bootstrap-ports", *(str(b) for _, b in prefills),
            "--decode", *(d.url for d in decodes), "--health-check-interval-s", "0.5", *extra]
    return Proc(name, argv, port)


def scheduler_stats(proc: Proc) -> dict:
    reply = proc.get("/get_server_info")
    assert reply.status == 200, reply.body
    return reply.json()["scheduler"]


def wait_kv_free(procs: Iterable[Proc], timeout: float = 15.0) -> None:
    """Every server's KV pool is fully free (pages may be released a few scheduler steps after the answer)."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        while not (stats := scheduler_stats(proc))["kv_pool_fully_free"]:
            assert time.monotonic() < deadline, f"{proc.name} still holds KV pages: {stats}"
            time.sleep(0.1)


@dataclass
class PDCluster:
    backend: str
    prefill: Proc
    bootstrap_port: int
    decode: Proc
    router: Proc
    extra: list[Proc] = field(default_factory=list)

    @property
    def servers(self) -> list[Proc]:
        return [self.prefill, self.decode]
