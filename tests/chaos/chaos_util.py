"""Helpers for the chaos tests: PD request pairs sent straight to a prefill and a decode, pool checks."""

from __future__ import annotations

import random
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
