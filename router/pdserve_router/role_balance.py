"""Automatic P:D balance (`--balance-roles`) and the admin route `POST /pd_role_switch` (SGLang mini_lb's): a PD server started with
`--enable-pd-role-switch` changes role, without a restart, when one side's queue stays long while the other idles.

An instance's pressure, from its `/load` (1.0: at its threshold):
- a prefill's: the seconds its queued prompt tokens take at its measured prefill rate, over
  `--balance-prefill-wait-s`;
- a decode's: its decode step time over `--balance-decode-step-ms` while it decodes, or its KV usage over KV_FULL,
  whichever is higher.
A side's pressure is the mean of its instances'. When one side's pressure stays at 1 or above for
`--balance-window-s` while the other side's stays at `--balance-idle-pressure` or below (a decode step has a floor,
the time to read the weights, well above zero: 0.7 by default), and the idle side has more than one
instance in rotation, its least loaded instance switches to the busy side's role: it leaves routing (its requests
in flight finish there), is asked to switch (`POST /pd_role_switch`: the server drains and switches, or refuses
and keeps its role), and re-registers under the role it serves afterwards. At most one switch runs at a time, none
within `--balance-cooldown-s` of the last, and never one that takes the last instance of a role. Each decision is
logged in one line and counted in `pdserve_router_role_switches_total`. An instance whose `/load` names another
role than it is registered under (switched by someone else, or its answer after a switch was lost) is registered
again under the role it reports.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from .cluster_auth import HEADER, RequestSigner
from .config import RouterConfig
from .metrics import RouterMetrics
from .workers import PeriodicPoller, Worker, WorkerRegistry, normalize_url

log = logging.getLogger("pdserve_router")
PD_ROLES = ("prefill", "decode")
KV_FULL = 0.9  # a decode instance using this share of its KV pool is at its threshold
SWITCH_PATH = "/pd_role_switch"
SWITCH_SECONDS = 600.0  # beyond the drain: the server warms its new role up before it answers


@dataclass(frozen=True, slots=True)
class RoleLoad:
    """What the balance reads of one `/load` answer."""

    mode: str  # the role the instance serves now
    queued_tokens: int
    prefill_tokens_per_s: float
    decode_step_ms: float
    num_running: int
    kv_usage: float


def parse_role_load(body: object) -> RoleLoad | None:
    """A `/load` answer, or None when a field is missing, of the wrong type or out of range."""
    if not isinstance(body, dict):
        return None
    mode = body.get("disaggregation_mode")
    queued, running = body.get("queued_prefill_tokens"), body.get("num_running_reqs")
    rates = [body.get(key) for key in ("prefill_tokens_per_s", "decode_step_ms", "kv_usage")]
    if mode not in PD_ROLES or not all(type(n) is int and 0 <= n < 1 << 40 for n in (queued, running)):
        return None
    if not all(isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r < math.inf for r in rates):
        return None
    rate, step_ms, kv_usage = (float(r) for r in rates)
    return RoleLoad(mode, queued, rate, step_ms, running, min(kv_usage, 1.0))


@dataclass(frozen=True, slots=True)
class Move:
    url: str
    to_role: str
    reason: str


@dataclass(frozen=True, slots=True)
class BalancePolicy:
    prefill_wait_s: float
    decode_step_ms: float
    idle_pressure: float  # a side at or below this pressure idles

    def pressure(self, role: str, load: RoleLoad) -> float | None:
        """The instance's pressure in `role`; None when it cannot be told (a queue at an unmeasured rate)."""
        if role == "prefill":
            if load.queued_tokens == 0:
                return 0.0
            if load.prefill_tokens_per_s <= 0:
                return None
            return load.queued_tokens / load.prefill_tokens_per_s / self.prefill_wait_s
        stepping = load.decode_step_ms / self.decode_step_ms if load.num_running else 0.0
        return max(stepping, load.kv_usage / KV_FULL)

    def wanted(self, sides: Mapping[str, Sequence[tuple[str, RoleLoad | None]]]) -> Move | None:
        """The switch this poll alone asks for: `sides` holds each role's instances in rotation as (url, load)."""
        pressures: dict[str, list[tuple[float, str]]] = {}
        for role in PD_ROLES:
            scored = [(self.pressure(role, load), url) for url, load in sides.get(role, ()) if load is not None]
            if not scored or len(scored) < len(sides[role]) or any(p is None for p, _ in scored):
                return None  # a side without a full, readable picture: no decision
            pressures[role] = scored
        for busy, idle in (PD_ROLES, PD_ROLES[::-1]):
            busy_mean, idle_mean = mean(pressures[busy]), mean(pressures[idle])
            if busy_mean >= 1.0 and idle_mean <= self.idle_pressure and len(pressures[idle]) > 1:
                _, url = min(pressures[idle])
                return Move(url, busy, f"{busy} pressure {busy_mean:.2f} >= 1 while {idle} pressure "
                                       f"{idle_mean:.2f} <= {self.idle_pressure:g}")
        return None


def mean(scored: list[tuple[float, str]]) -> float:
    return sum(p for p, _ in scored) / len(scored)


class BalanceWindow:
    """Hysteresis: a move is made only after the same direction was wanted at every poll for `window_s`, with no
    switch in flight and `cooldown_s` after the last one ended."""

    def __init__(self, window_s: float, cooldown_s: float):
        self.window_s, self.cooldown_s = window_s, cooldown_s
        self.direction: str | None = None  # the role wanted more of, since `since`
        self.since = 0.0
        self.last_switch_ended = -math.inf

    def observe(self, now: float, move: Move | None) -> Move | None:
        """The move to make now, if any."""
        direction = move.to_role if move is not None else None
        if direction != self.direction:
            self.direction, self.since = direction, now
        if move is None or now - self.since < self.window_s or now - self.last_switch_ended < self.cooldown_s:
            return None
        return move

    def switch_ended(self, now: float) -> None:
        self.direction, self.last_switch_ended = None, now


class SwitchRefused(Exception):
    """A switch the router will not ask for; `status` is its HTTP answer."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class RoleSwitcher:
    """Runs one switch at a time: out of routing, `POST /pd_role_switch`, back in under the role it serves."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry, session: aiohttp.ClientSession,
                 metrics: RouterMetrics):
        self.config, self.registry, self.session, self.metrics = config, registry, session, metrics
        self.auth = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.signer = RequestSigner(config.disaggregation_secret) if config.disaggregation_secret else None
        self.busy = False

    def check(self, url: str, to_role: str) -> Worker:
        """The worker to switch; SwitchRefused when the switch may not run now."""
        if to_role not in PD_ROLES:
            raise SwitchRefused(400, f"role must be one of {', '.join(PD_ROLES)}")
        worker = self.registry.workers.get(normalize_url(url))
        if worker is None:
            raise SwitchRefused(404, f"no worker {url}")
        if worker.role == to_role:
            raise SwitchRefused(400, f"{worker.url} is a {to_role} instance already")
        if self.busy:
            raise SwitchRefused(409, "a role switch is already under way")
        others = [w for w in self.registry.of_role(worker.role) if w is not worker and w.in_rotation]
        if not others:
            raise SwitchRefused(409, f"{worker.url} is the last {worker.role} instance in rotation")
        return worker

    async def switch(self, url: str, to_role: str, reason: str) -> dict:
        """Switch the instance at `url` to `to_role`; the outcome as JSON. SwitchRefused before anything changed."""
        worker = self.check(url, to_role)
        self.busy = True
        started = time.monotonic()
        self.registry.remove(worker.url)  # out of routing: no new request goes there
        try:
            answer = await self.ask(worker, to_role)
        finally:
            try:
                role, port = await self.role_now(worker)
                self.registry.add(worker.url, role, port)
            finally:
                self.busy = False
        outcome = "switched" if role == to_role else "refused"
        self.metrics.role_switches.labels(to_role=to_role, outcome=outcome).inc()
        log.warning("role switch: %s %s -> %s %s in %.1f s (%s)%s", worker.role, worker.url, to_role, outcome,
                    time.monotonic() - started, reason, "" if outcome == "switched" else f": {answer['message']}")
        return {"worker_url": worker.url, "old_role": worker.role, "role": role, "outcome": outcome, **answer}

    async def follow(self, worker: Worker) -> None:
        """Register `worker` again under the role it reports serving now, unless a switch is under way."""
        if self.busy or self.registry.workers.get(worker.url) is not worker:
            return
        self.busy = True
        try:
            role, port = await self.role_now(worker)
            if role != worker.role and self.registry.workers.get(worker.url) is worker:
                self.registry.remove(worker.url)
                self.registry.add(worker.url, role, port)
                self.metrics.role_switches.labels(to_role=role, outcome="followed").inc()
                log.warning("role switch: %s %s serves as %s now (switched outside this router); registered again",
                            worker.role, worker.url, role)
        finally:
            self.busy = False

    async def ask(self, worker: Worker, to_role: str) -> dict:
        body = json.dumps({"new_role": to_role, "drain_timeout_s": self.config.balance_drain_timeout_s}).encode()
        headers = {"Content-Type": "application/json", **self.auth}
        if self.signer is not None:
            headers[HEADER] = self.signer.token(SWITCH_PATH, body)
        timeout = aiohttp.ClientTimeout(total=self.config.balance_drain_timeout_s + SWITCH_SECONDS)
        try:
            async with self.session.post(worker.url + SWITCH_PATH, data=body, headers=headers, timeout=timeout) as resp:
                return {"status": resp.status, "message": upstream_message(await resp.read())}
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return {"status": None, "message": str(exc) or type(exc).__name__}

    async def role_now(self, worker: Worker) -> tuple[str, int | None]:
        """The role and bootstrap port the instance reports on /get_server_info; its old ones when it does not
        answer."""
        try:
            async with self.session.get(worker.url + "/get_server_info", headers=self.auth,
                                        timeout=aiohttp.ClientTimeout(total=self.config.admin_timeout_s)) as resp:
                info = json.loads(await resp.read()) if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            info = None
        mode = info.get("disaggregation_mode") if isinstance(info, dict) else None
        port = info.get("disaggregation_bootstrap_port") if isinstance(info, dict) else None
        if mode not in PD_ROLES or not (type(port) is int and 0 < port < 65536):
            return worker.role, worker.bootstrap_port
        return mode, port


def upstream_message(body: bytes) -> str:
    """The error message of a JSON error answer, else the body's first characters."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")
    return str(error.get("message") if isinstance(error, dict) else error)[:500]


class RoleBalancer(PeriodicPoller):
    """Polls every PD instance's `/load` each `--balance-interval-s` and starts the switch the window lets through."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry, session: aiohttp.ClientSession,
                 switcher: RoleSwitcher):
        self.registry, self.session, self.switcher = registry, session, switcher
        self.headers = switcher.auth
        self.interval_s = config.balance_interval_s
        self.timeout_s = config.health_check_timeout_s
        self.policy = BalancePolicy(config.balance_prefill_wait_s, config.balance_decode_step_ms,
                                    config.balance_idle_pressure)
        self.window = BalanceWindow(config.balance_window_s, config.balance_cooldown_s)
        self.running: asyncio.Task | None = None

    async def check_all(self) -> None:
        workers = [w for w in self.registry.workers.values() if w.in_rotation]
        loads = [parse_role_load(body) for body in await asyncio.gather(*(self.get_json(w.url + "/load")
                                                                         for w in workers))]
        if self.switcher.busy or (self.running is not None and not self.running.done()):
            return
        stray = next((w for w, load in zip(workers, loads) if load is not None and load.mode != w.role), None)
        if stray is not None:
            self.running = asyncio.create_task(self.switcher.follow(stray))
            return
        sides = {role: [(w.url, load) for w, load in zip(workers, loads) if w.role == role] for role in PD_ROLES}
        move = self.window.observe(time.monotonic(), self.policy.wanted(sides))
        if move is not None:
            self.running = asyncio.create_task(self.run_move(move))

    async def run_move(self, move: Move) -> None:
        try:
            await self.switcher.switch(move.url, move.to_role, move.reason)
        except SwitchRefused as exc:
            log.info("role switch of %s to %s not started: %s", move.url, move.to_role, exc)
        finally:
            self.window.switch_ended(time.monotonic())

    async def stop(self) -> None:
        await super().stop()
        if self.running is not None:
            self.running.cancel()
            await asyncio.gather(self.running, return_exceptions=True)
