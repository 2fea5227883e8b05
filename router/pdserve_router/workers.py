"""Worker registry: which instances exist, which are healthy, how loaded they are, and their circuit breakers."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from .conditional import BookedTokens, InstanceLoad, Option, parse_load
from .config import ConfigError, Role, RouterConfig
from .reported_cache import CacheReport, parse_cache_report

log = logging.getLogger("pdserve_router")
MAX_POLL_BYTES = 1 << 16  # of a polled answer such as /load
MAX_REPORT_BYTES_PER_ENTRY = 24  # a /cache_report lists hashes as '"0123456789abcdef", '


class NoHealthyWorker(Exception):
    """No instance of a role can take a request right now."""


@dataclass(slots=True)
class CircuitBreaker:
    """closed -> open after `failure_threshold` consecutive failures; open -> half_open after `open_duration_s`;
    half_open -> closed after `success_threshold` successes, back to open on any failure."""

    failure_threshold: int
    success_threshold: int
    open_duration_s: float
    state: str = "closed"
    failures: int = 0
    successes: int = 0
    opened_at: float = 0.0

    def allows(self, now: float) -> bool:
        if self.state == "open" and now - self.opened_at >= self.open_duration_s:
            self.state, self.successes = "half_open", 0
        return self.state != "open"

    def reset(self) -> None:
        """An instance that came back (it passed its health checks again) starts with a clean record."""
        self.state, self.failures, self.successes = "closed", 0, 0

    def record(self, ok: bool, now: float) -> None:
        if ok:
            self.failures = 0
            self.successes += 1
            if self.state == "half_open" and self.successes >= self.success_threshold:
                self.state = "closed"
            return
        self.successes = 0
        self.failures += 1
        if self.state == "half_open" or self.failures >= self.failure_threshold:
            self.state, self.opened_at = "open", now


@dataclass(slots=True)
class Worker:
    url: str
    role: Role
    breaker: CircuitBreaker
    bootstrap_port: int | None = None
    healthy: bool = True  # in rotation (dispatch tries a new instance before its first health check)
    ready: bool = False  # has passed at least one health check; the router's /health waits for it
    in_flight: int = 0
    health_failures: int = 0
    health_successes: int = 0
    load: InstanceLoad | None = None  # its last `/load` answer (conditional disaggregation)
    load_asked_at: float = 0.0  # time.monotonic() when that answer was asked for
    booked: BookedTokens = field(default_factory=BookedTokens)  # prompt tokens sent to it, not yet prefilled
    cache_report: CacheReport | None = None  # its last `/cache_report` (cache-aware policy, reported source)
    bootstrap_host: str = field(init=False)

    def __post_init__(self) -> None:
        self.url = normalize_url(self.url)
        host = urlsplit(self.url).hostname or ""
        self.bootstrap_host = f"[{host}]" if ":" in host else host

    def available(self, now: float) -> bool:
        return self.healthy and self.breaker.allows(now)

    @property
    def in_rotation(self) -> bool:
        """What `available` would say, without letting an open breaker turn half-open (for reports)."""
        return self.healthy and self.breaker.state != "open"

    def option(self) -> Option:
        """This instance for the load-aware rule: its last load and the booked tokens that load cannot show."""
        return Option(self.load, self.booked.unseen(self.load_asked_at))

    def describe(self) -> dict:
        info = {"url": self.url, "role": self.role, "bootstrap_port": self.bootstrap_port, "healthy": self.healthy,
                "ready": self.ready, "circuit": self.breaker.state, "in_flight": self.in_flight}
        if self.load is not None:
            info["load"] = {"queued_prefill_tokens": self.load.queued_tokens,
                            "prefill_tokens_per_s": self.load.tokens_per_s,
                            "local_prefill_tokens_per_s": self.load.local_tokens_per_s,
                            "local_prefill_burst_s": self.load.burst_s,
                            "kv_usage": self.load.kv_usage, "booked_tokens": self.option().booked_tokens}
        if self.cache_report is not None:
            report = self.cache_report
            info["cache_report"] = {"device_blocks": len(report.device), "host_blocks": len(report.host),
                                    "block_chars": report.block_chars,
                                    "age_s": round(time.monotonic() - report.received_at, 3)}
        return info


def normalize_url(url: str) -> str:
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"not an http(s) URL: {url!r}")
    return url.strip().rstrip("/")


class WorkerRegistry:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.workers: dict[str, Worker] = {}

    def add(self, url: str, role: Role, bootstrap_port: int | None = None) -> Worker:
        allowed = ("regular",) if self.config.mode == "regular" else ("prefill", "decode")
        if role not in allowed:
            raise ConfigError(f"role must be one of {', '.join(allowed)} in {self.config.mode} mode")
        c = self.config
        worker = Worker(url, role, CircuitBreaker(c.cb_failure_threshold, c.cb_success_threshold, c.cb_open_duration_s),
                        bootstrap_port if role == "prefill" else None)
        if worker.url in self.workers:
            raise KeyError(f"worker {worker.url} is already registered")
        self.workers[worker.url] = worker
        log.info("added %s worker %s", role, worker.url)
        return worker

    def remove(self, url: str) -> Worker:
        worker = self.workers.pop(normalize_url(url))
        log.info("removed %s worker %s", worker.role, worker.url)
        return worker

    def of_role(self, role: Role) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role]

    def available(self, role: Role, exclude: frozenset[str] = frozenset()) -> list[Worker]:
        """Healthy instances with a closed breaker, preferring ones not in `exclude` (already failed this request)."""
        now = time.monotonic()
        ready = [w for w in self.workers.values() if w.role == role and w.available(now)]
        if not ready:
            total = len(self.of_role(role))
            raise NoHealthyWorker(f"no healthy {role} instance available ({total} registered, 0 healthy)")
        fresh = [w for w in ready if w.url not in exclude]
        return fresh or ready

    def record(self, worker: Worker, ok: bool) -> None:
        worker.breaker.record(ok, time.monotonic())


class PeriodicPoller(ABC):
    """A background task that runs `check_all()` every `interval_s` seconds until stopped."""

    interval_s: float
    timeout_s: float
    session: aiohttp.ClientSession
    headers: dict[str, str]
    task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self.task:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def get_json(self, url: str, max_bytes: int = MAX_POLL_BYTES) -> object | None:
        """The JSON body of a GET, or None on any failure, a non-200 status, or a body over `max_bytes`."""
        try:
            async with self.session.get(url, headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                body = await resp.content.read(max_bytes + 1)
                if resp.status != 200 or len(body) > max_bytes:
                    return None
            return json.loads(body)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, RecursionError):
            return None

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check_all()

    @abstractmethod
    async def check_all(self) -> None:
        """One round of polls over the registered workers."""


class HealthChecker(PeriodicPoller):
    """Polls every worker's health endpoint; thresholds of consecutive results flip `Worker.healthy`."""

    def __init__(self, registry: WorkerRegistry, session: aiohttp.ClientSession, headers: dict[str, str]):
        self.registry = registry
        self.session = session
        self.headers = headers
        self.interval_s = registry.config.health_check_interval_s

    async def check_all(self) -> None:
        workers = list(self.registry.workers.values())
        results = await asyncio.gather(*(self.probe(w) for w in workers))
        for worker, ok in zip(workers, results):
            self.update(worker, ok)

    async def probe(self, worker: Worker) -> bool:
        c = self.registry.config
        try:
            async with self.session.get(worker.url + c.health_check_endpoint, headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=c.health_check_timeout_s)) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    def update(self, worker: Worker, ok: bool) -> None:
        c = self.registry.config
        if ok:
            worker.ready = True
            worker.health_failures, worker.health_successes = 0, worker.health_successes + 1
            if not worker.healthy and worker.health_successes >= c.health_success_threshold:
                worker.healthy = True
                worker.breaker.reset()
                log.warning("%s worker %s is healthy again; back in rotation", worker.role, worker.url)
            return
        worker.health_successes, worker.health_failures = 0, worker.health_failures + 1
        if worker.healthy and worker.health_failures >= c.health_failure_threshold:
            worker.healthy = False
            log.warning("%s worker %s failed %d health checks; out of rotation", worker.role, worker.url,
                        worker.health_failures)


class LoadPoller(PeriodicPoller):
    """Reads the `/load` of every instance whose role the local-prefill rule weighs (conditional disaggregation);
    one that does not answer has no load."""

    def __init__(self, registry: WorkerRegistry, session: aiohttp.ClientSession, headers: dict[str, str]):
        self.registry, self.session, self.headers = registry, session, headers
        self.roles = registry.config.load_poll_roles()
        self.interval_s = registry.config.load_poll_interval_s
        self.timeout_s = registry.config.health_check_timeout_s

    async def check_all(self) -> None:
        workers = [w for role in self.roles for w in self.registry.of_role(role)]
        asked_at = time.monotonic()
        loads = await asyncio.gather(*(self.poll(w.url) for w in workers))
        for worker, load in zip(workers, loads):
            worker.load, worker.load_asked_at = load, asked_at

    async def poll(self, url: str) -> InstanceLoad | None:
        return parse_load(await self.get_json(url + "/load"))


class CacheReportPoller(PeriodicPoller):
    """Reads the `/cache_report` of every instance whose role routes by reported prefixes. An instance that does
    not answer keeps its last report until that one is too old to count (`--cache-report-ttl-s`)."""

    def __init__(self, registry: WorkerRegistry, session: aiohttp.ClientSession, headers: dict[str, str]):
        self.registry, self.session, self.headers = registry, session, headers
        self.roles = registry.config.reported_cache_roles()
        self.interval_s = registry.config.cache_report_interval_s
        self.timeout_s = registry.config.health_check_timeout_s
        self.max_entries = registry.config.cache_max_entries

    async def check_all(self) -> None:
        workers = [w for role in self.roles for w in self.registry.of_role(role)]
        reports = await asyncio.gather(*(self.poll(w.url) for w in workers))
        for worker, report in zip(workers, reports):
            if report is not None:
                worker.cache_report = report

    async def poll(self, url: str) -> CacheReport | None:
        body = await self.get_json(url + "/cache_report", max_bytes=MAX_REPORT_BYTES_PER_ENTRY * self.max_entries)
        return parse_cache_report(body, self.max_entries, time.monotonic())
