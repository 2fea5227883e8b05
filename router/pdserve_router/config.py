"""The router's whole configuration: one frozen dataclass built by the CLI."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Mode = Literal["pd", "regular"]
Role = Literal["prefill", "decode", "regular"]
POLICIES = ("random", "round_robin", "least_load", "cache_aware")
CACHE_AWARE_SOURCES = ("local", "reported", "both")
EVENT_LOOPS = ("auto", "uvloop", "asyncio")
DEFAULT_BOOTSTRAP_PORT = 8998  # a prefill's bootstrap port when neither the flag nor the worker names one


class ConfigError(ValueError):
    """A flag value or combination that cannot work; raised before anything starts."""


@dataclass(frozen=True, slots=True)
class RouterConfig:
    mode: Mode = "pd"
    prefill_urls: tuple[str, ...] = ()
    bootstrap_ports: tuple[int | None, ...] = ()
    decode_urls: tuple[str, ...] = ()
    worker_urls: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    disaggregation_secret: str | None = None
    log_level: str = "info"
    event_loop: str = "auto"
    # policies
    policy: str = "round_robin"
    prefill_policy: str = "cache_aware"
    decode_policy: str = "least_load"
    cache_threshold: float = 0.5
    cache_block_chars: int = 16
    cache_max_entries: int = 65536
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    cache_aware_source: str = "local"  # local: the router's own index; reported: the instances' /cache_report
    cache_report_interval_s: float = 1.0
    cache_report_ttl_s: float = 10.0
    # conditional disaggregation (pd mode): some requests go to a decode instance alone, which prefills them
    local_prefill_max_tokens: int = 0
    local_prefill_cost_factor: float = 0.0
    local_prefill_by_load: bool = False  # predicted TTFT on both paths from the instances' /load (LoadAwareRule)
    local_prefill_alpha: float = 1.0
    local_prefill_kv_gate: float = 0.9
    load_poll_interval_s: float = 0.1
    # automatic P:D balance (pd mode): instances started with --enable-pd-role-switch change role
    balance_roles: bool = False
    balance_interval_s: float = 1.0
    balance_prefill_wait_s: float = 0.5
    balance_decode_step_ms: float = 10.0
    balance_idle_pressure: float = 0.7
    balance_window_s: float = 5.0
    balance_cooldown_s: float = 20.0
    balance_drain_timeout_s: float = 30.0
    # requests
    request_timeout_s: float = 600.0
    request_body_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    unreachable_timeout_s: float = 30.0
    max_retries: int = 3
    retry_backoff_s: float = 0.02
    retry_max_backoff_s: float = 1.0
    abort_timeout_s: float = 2.0
    admin_timeout_s: float = 60.0
    shutdown_drain_timeout_s: float = 30.0
    request_timeline_log: str | None = None  # one JSON line per finished request (pdserve.bench.timeline reads it)
    # health checks
    health_check_interval_s: float = 5.0
    health_check_timeout_s: float = 2.0
    health_check_endpoint: str = "/health"
    health_failure_threshold: int = 2
    health_success_threshold: int = 1
    # circuit breaker
    cb_failure_threshold: int = 5
    cb_success_threshold: int = 2
    cb_open_duration_s: float = 10.0

    def __post_init__(self) -> None:
        if self.mode == "regular" and (self.prefill_urls or self.decode_urls):
            raise ConfigError("--worker (regular mode) cannot be combined with --prefill/--decode")
        if self.mode == "pd" and self.worker_urls:
            raise ConfigError("--worker is only for regular mode")
        if len(self.bootstrap_ports) != len(self.prefill_urls):
            raise ConfigError("need exactly one bootstrap port per prefill URL")
        for name in ("policy", "prefill_policy", "decode_policy"):
            if getattr(self, name) not in POLICIES:
                raise ConfigError(f"--{name.replace('_', '-')} must be one of {', '.join(POLICIES)}")
        if self.cache_aware_source not in CACHE_AWARE_SOURCES:
            raise ConfigError(f"--cache-aware-source must be one of {', '.join(CACHE_AWARE_SOURCES)}")
        if self.cache_report_interval_s <= 0 or self.cache_report_ttl_s <= 0:
            raise ConfigError("--cache-report-interval-s and --cache-report-ttl-s must be > 0")
        if self.event_loop not in EVENT_LOOPS:
            raise ConfigError(f"--event-loop must be one of {', '.join(EVENT_LOOPS)}")
        if self.api_key is not None and any(c in self.api_key for c in "\r\n"):
            raise ConfigError("--api-key must be one line")
        if (self.max_retries < 0 or min(self.request_timeout_s, self.request_body_timeout_s,
                                        self.health_check_interval_s) <= 0):
            raise ConfigError("--max-retries must be >= 0 and the timeouts/intervals > 0")
        if self.unreachable_timeout_s < 1:
            raise ConfigError("--unreachable-timeout-s must be at least 1 (TCP keep-alive counts whole seconds)")
        if min(self.health_failure_threshold, self.health_success_threshold, self.cb_failure_threshold,
               self.cb_success_threshold, self.cache_block_chars) < 1:
            raise ConfigError("thresholds and --cache-block-chars must be >= 1")
        if self.local_prefill_max_tokens < 0 or self.local_prefill_cost_factor < 0 or self.load_poll_interval_s <= 0:
            raise ConfigError("--local-prefill-max-tokens and --local-prefill-cost-factor must be >= 0 and "
                              "--load-poll-interval-s > 0")
        if self.local_prefill_by_load and (self.local_prefill_max_tokens or self.local_prefill_cost_factor):
            raise ConfigError("--local-prefill-by-load replaces --local-prefill-max-tokens and "
                              "--local-prefill-cost-factor: give one rule")
        if not 0 < self.local_prefill_alpha < math.inf or not 0 < self.local_prefill_kv_gate <= 1:
            raise ConfigError("--local-prefill-alpha must be a finite number > 0 and --local-prefill-kv-gate in (0, 1]")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ConfigError("--cache-threshold must be in [0, 1]")
        self.validate_balance()

    def validate_balance(self) -> None:
        if self.balance_roles and self.mode != "pd":
            raise ConfigError("--balance-roles needs pd mode (--prefill and --decode instances)")
        knobs = (self.balance_interval_s, self.balance_prefill_wait_s, self.balance_decode_step_ms,
                 self.balance_drain_timeout_s)
        if not all(0 < k < math.inf for k in knobs) or not 0 <= self.balance_window_s < math.inf \
                or not 0 <= self.balance_cooldown_s < math.inf or not 0 < self.balance_idle_pressure < 1:
            raise ConfigError("--balance-interval-s, --balance-prefill-wait-s, --balance-decode-step-ms and "
                              "--balance-drain-timeout-s must be > 0, --balance-window-s and --balance-cooldown-s "
                              ">= 0 (all finite), --balance-idle-pressure in (0, 1)")

    def policy_for(self, role: Role) -> str:
        return {"prefill": self.prefill_policy, "decode": self.decode_policy, "regular": self.policy}[role]

    def load_poll_roles(self) -> tuple[Role, ...]:
        """The roles whose /load the local-prefill rule reads: both for the load-aware rule, the prefills for the
        cost factor, none otherwise (and outside pd mode)."""
        if self.mode != "pd":
            return ()
        if self.local_prefill_by_load:
            return ("prefill", "decode")
        return ("prefill",) if self.local_prefill_cost_factor > 0 else ()

    def reported_cache_roles(self) -> tuple[Role, ...]:
        """The roles whose cache-aware policy reads the instances' reports (their /cache_report is polled)."""
        if self.cache_aware_source == "local":
            return ()
        roles: tuple[Role, ...] = ("prefill", "decode") if self.mode == "pd" else ("regular",)
        return tuple(role for role in roles if self.policy_for(role) == "cache_aware")
