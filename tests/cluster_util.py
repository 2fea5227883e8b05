"""Real pdserve servers and routers as subprocesses on loopback, for the PD and router end-to-end tests.

Start several processes at once (`start_all`): on a 2-core box the model loads overlap, so a cluster costs
about one server's start-up time.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve import server_processes
from pdserve.ports import free_port
from pdserve.server_processes import stop_all

STARTUP_TIMEOUT = 480.0  # generous: CI boxes shared with other jobs start servers slowly
CONTEXT_LENGTH = 512
MAX_TOTAL_TOKENS = 4096
# small PD timeouts so that failure tests end in seconds
PD_TIMEOUTS = ["--disaggregation-bootstrap-timeout", "6", "--disaggregation-waiting-timeout", "6",
               "--disaggregation-heartbeat-interval", "0.5", "--disaggregation-heartbeat-failures", "2"]
# The session's shared servers (tests/conftest.py `shared_servers`), one set for the bench, fuzz and PD tests:
SHARED_CHUNK_SIZE = 32  # the prefill's --chunked-prefill-size: the PD tests' ~100-token prompts are prefilled in chunks
SHARED_MAX_BATCH_ITEMS = 4096  # large batches, so that tokenizing one takes seconds (tests/fuzz/test_event_loop.py)
SHARED_COLOCATED_ARGS = ["--max-batch-items", str(SHARED_MAX_BATCH_ITEMS)]
# a prefill waiting for its staging answers as long as they take: whether a handoff is staged must not depend on how
# busy the test machine's cores are
STAGING_WAIT_ARGS = ["--disaggregation-staging-wait-ms", "30000"]
# tcp prefill: chunks of 16+ tokens push KV layer by layer during the forward, shorter ones after it
SHARED_PREFILL_ARGS = ["--chunked-prefill-size", str(SHARED_CHUNK_SIZE), "--disaggregation-layerwise-min-tokens", "16",
                       *STAGING_WAIT_ARGS]
# one intra-op thread per process: several servers share a few cores, and oversubscription makes each token slower
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


NO_MOONCAKE = "mooncake.engine cannot be imported (pip install mooncake-transfer-engine-non-cuda)"


def mooncake_available() -> bool:
    try:
        return importlib.util.find_spec("mooncake.engine") is not None
    except ImportError:
        return False


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


def send_stalled_body(url: str) -> tuple[bytes, float]:
    """POST headers and the start of a body to `url`, then stall: the answer's first bytes and the seconds until
    they came."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"text\"")
        started = time.monotonic()
        return sock.recv(65536), time.monotonic() - started


class Proc(server_processes.Proc):
    """A launched server or router with the test's HTTP shortcuts."""

    def get(self, path: str, **kwargs) -> Reply:
        return http("GET", self.url + path, **kwargs)

    def post(self, path: str, body: dict | bytes | None = None, **kwargs) -> Reply:
        return http("POST", self.url + path, body, **kwargs)


def start_all(procs: list[Proc]) -> list[Proc]:
    """Launch every process, then wait until all answer /health; on failure stop them all."""
    return server_processes.start_all(procs, STARTUP_TIMEOUT)


def start_with_router(servers: list[Proc], make_router: Callable[[], Proc]) -> Proc:
    """Starts the servers, then the router `make_router` builds in front of them; a router that fails to start stops
    the servers before its error goes on."""
    start_all(servers)
    front = make_router()
    try:
        start_all([front])
    except BaseException:
        stop_all(servers)
        raise
    return front


def server(name: str, model: str, *extra: str, port: int | None = None, kind: type[Proc] = Proc, **fields) -> Proc:
    """A server on the CPU with a small KV pool; `extra` flags come last and win. `kind` and `fields`: a subclass
    of Proc with its own fields."""
    port = port or free_port()
    argv = server_processes.server_argv(model, port, "--max-total-tokens", str(MAX_TOTAL_TOKENS),
                                        "--context-length", str(CONTEXT_LENGTH), *extra)
    return kind(name, argv, f"http://127.0.0.1:{port}", env=CHILD_ENV, **fields)


def prefill_server(model: str, backend: str, bootstrap_port: int, *extra: str) -> Proc:
    role = server_processes.prefill_flags(backend, bootstrap_port)
    return server(f"prefill-{backend}", model, *role, *PD_TIMEOUTS, *extra)


def decode_server(model: str, backend: str, *extra: str, name: str = "") -> Proc:
    return server(name or f"decode-{backend}", model, *server_processes.decode_flags(backend),
                  "--num-reserved-decode-tokens", "64", *PD_TIMEOUTS, *extra)


def router(prefills: list[tuple[Proc, int]], decodes: list[Proc], *extra: str, name: str = "router") -> Proc:
    port = free_port()
    pd_flags = server_processes.pd_router_flags([(p.url, b) for p, b in prefills], [d.url for d in decodes])
    argv = server_processes.router_argv(port, "--log-level", "warning", *pd_flags, "--health-check-interval-s", "0.5",
                                        *extra)
    return Proc(name, argv, f"http://127.0.0.1:{port}", env=CHILD_ENV)


def regular_router(workers: list[Proc], *extra: str, name: str = "router-regular") -> Proc:
    """A router in front of colocated servers."""
    port = free_port()
    worker_flags = [flag for w in workers for flag in ("--worker", w.url)]
    argv = server_processes.router_argv(port, "--log-level", "warning", *worker_flags, *extra)
    return Proc(name, argv, f"http://127.0.0.1:{port}", env=CHILD_ENV)


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


class ProcessInfo(NamedTuple):
    state: str
    parent: int
    session: int


def process_info(pid: int) -> ProcessInfo | None:
    """State, parent pid and session id of a live process, from /proc; None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else ProcessInfo(fields[0], int(fields[1]), int(fields[3]))


def still_alive(pids: Iterable[int], timeout: float = 10.0) -> list[int]:
    """The `pids` still alive after waiting up to `timeout` for all of them to exit."""
    deadline = time.monotonic() + timeout
    while (alive := [pid for pid in pids if process_info(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def live_processes() -> dict[int, ProcessInfo]:
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := process_info(int(entry))) is not None:
            found[int(entry)] = info
    return found


def descendants(pid: int) -> list[int]:
    """Live (not zombie) processes below `pid`."""
    children: dict[int, list[int]] = {}
    for child, info in live_processes().items():
        children.setdefault(info.parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def live_session_members(sid: int) -> list[int]:
    return [pid for pid, info in live_processes().items() if info.session == sid]


_RELEASES: dict[str, list[Callable[[], None]]] = {}  # fixture name -> its stop callbacks not yet run
_LAST_USER: dict[str, int] = {}  # fixture name -> index in session.items of the last test that uses it


def release_after_last_user(request, stop: Callable[[], None]) -> Callable[[], None]:
    """Run `stop` (once) right after the teardown of the last collected test that uses the session fixture
    `request` belongs to (tests/conftest.py's teardown hook), rather than at the end of the session: its processes
    do not sit idle on the CPU through the rest of the suite. Returns the once-only stop for the fixture's own
    teardown (a no-op by then)."""
    done = []

    def once() -> None:
        if not done:
            done.append(True)
            stop()

    _RELEASES.setdefault(request.fixturename, []).append(once)
    return once


def releases_due(item) -> list[Callable[[], None]]:
    """The stops to run after `item`'s teardown: those of fixtures no test after it in the session uses."""
    if not _RELEASES:
        return []
    items = item.session.items
    if getattr(item, "_pdserve_index", None) is None:
        for i, it in enumerate(items):
            it._pdserve_index = i
    index = getattr(item, "_pdserve_index", None)
    if index is None:  # not one of the session's items: leave the fixtures to the session's end
        return []
    due = []
    for name in list(_RELEASES):
        if name not in _LAST_USER:
            _LAST_USER[name] = max((i for i, it in enumerate(items) if name in it.fixturenames), default=-1)
        if index >= _LAST_USER[name]:
            due += _RELEASES.pop(name)
    return due
