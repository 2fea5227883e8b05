"""Helpers for the chaos tests: PD request pairs sent straight to a prefill and a decode, pool checks."""

from __future__ import annotations

from http.client import HTTPConnection, HTTPException
import json
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from cluster_util import Proc, Reply, http, scheduler_stats

POOL = ThreadPoolExecutor(max_workers=16, thread_name_prefix="chaos-client")


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 900) for _ in range(n)]


def pd_body(ids: list[int], bootstrap_port: int, room: int, max_new_tokens: int = 4, **extra) -> dict:
    return {"input_ids": ids, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
            "bootstrap_room": room, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                         "ignore_eos": True}, **extra}


def send_pair(prefill: Proc, decode: Proc, body: dict, timeout: float = 60.0) -> tuple[Future, Future]:
    """The same body to both halves at once, as the router sends it; futures of (Reply, seconds taken)."""
    def timed(proc: Proc) -> tuple[Reply, float]:
        started = time.monotonic()
        return http("POST", proc.url + "/generate", body, timeout=timeout), time.monotonic() - started
    return POOL.submit(timed, prefill), POOL.submit(timed, decode)


def wait_until(check, timeout: float, what: str, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(interval)


def holds_pages(proc: Proc) -> bool:
    return not scheduler_stats(proc)["kv_pool_fully_free"]


def wait_pool_free(proc: Proc, timeout: float) -> float:
    """Seconds until the server's KV pool is fully free, its prefix cache flushed first."""
    started = time.monotonic()

    def free() -> bool:
        http("POST", proc.url + "/flush_cache", timeout=10)
        return not holds_pages(proc)

    wait_until(free, timeout, f"{proc.name} frees its KV pool", interval=0.1)
    return time.monotonic() - started


class Stream:
    """A streamed /generate through the router, read on a thread: its status, events and when the first came."""

    def __init__(self, url: str, body: dict, timeout: float):
        self.status: int | None = None
        self.events: list[dict] = []
        self.broken: str | None = None  # the connection ended without `[DONE]`
        self.first_event = threading.Event()
        self.future = POOL.submit(self._read, url, body, timeout)

    def _read(self, url: str, body: dict, timeout: float) -> None:
        host, port = url.removeprefix("http://").split(":")
        conn = HTTPConnection(host, int(port), timeout=timeout)
        try:
            conn.request("POST", "/generate", json.dumps({**body, "stream": True}),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.status = resp.status
            done = False
            for line in resp:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: "):
                    self.events.append(json.loads(line[6:]))
                    self.first_event.set()
            if not done:
                self.broken = "the stream ended without [DONE]"
        except (OSError, HTTPException) as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
        finally:
            self.first_event.set()
            conn.close()

    def failed(self) -> bool:
        return self.status != 200 or self.broken is not None or any("error" in e for e in self.events)
