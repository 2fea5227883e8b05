"""Command line: mini_lb's flags (`--prefill`, `--prefill-bootstrap-ports`, `--decode`) plus regular mode and knobs."""

from __future__ import annotations

import argparse
import logging
from dataclasses import fields

from .cluster_auth import configured_secret
from .config import CACHE_AWARE_SOURCES, DEFAULT_BOOTSTRAP_PORT, EVENT_LOOPS, POLICIES, ConfigError, RouterConfig


_HTTP, _POLICIES, _CONDITIONAL, _BALANCE, _REQUESTS, _HEALTH, _BREAKER = (
    "http", "policies", "conditional disaggregation", "role balance", "requests", "health checks", "circuit breaker")
# flag: (its --help group, as the server groups its flags; its help)
_HELP: dict[str, tuple[str, str]] = {
    "host": (_HTTP, "Address to bind; 127.0.0.1 unless told otherwise."),
    "port": (_HTTP, "HTTP port."),
    "api_key": (_HTTP, "Sent to every instance as 'Authorization: Bearer KEY' and required from clients on all "
                       "routes but /health."),
    "disaggregation_secret": (_HTTP, "Cluster secret shared with the PD servers (else env "
                                     "PDSERVE_DISAGGREGATION_SECRET, else --api-key): signs each request's bootstrap fields so the "
                                     "servers accept them only from the router."),
    "log_level": (_HTTP, "debug, info, warning or error."),
    "event_loop": (_HTTP, "auto: uvloop when it is installed (pip install 'pdserve-router[fast]'), else asyncio; "
                          "uvloop: require it; asyncio: the standard loop even when uvloop is installed."),
    "policy": (_POLICIES, "Regular-mode policy."),
    "prefill_policy": (_POLICIES, "PD-mode policy for prefill instances."),
    "decode_policy": (_POLICIES, "PD-mode policy for decode instances."),
    "cache_threshold": (_POLICIES, "cache_aware: fraction of the prompt a known prefix must cover to win."),
    "cache_block_chars": (_POLICIES, "cache_aware: prefix granularity in characters (or token ids)."),
    "cache_max_entries": (_POLICIES, "cache_aware: most prefix blocks remembered (LRU)."),
    "cache_aware_source": (_POLICIES, "cache_aware: where prefixes are known from: local (the router's own index "
                                      "of where it sent each prefix, like SGLang's router), reported (each "
                                      "instance's /cache_report of the prefix blocks it holds per tier), or both "
                                      "(the longer match)."),
    "cache_report_interval_s": (_POLICIES, "cache_aware with reported/both: seconds between reads of each "
                                           "instance's /cache_report."),
    "cache_report_ttl_s": (_POLICIES, "cache_aware with reported/both: a report older than this many seconds is "
                                      "ignored."),
    "balance_abs_threshold": (_POLICIES, "cache_aware: ignore the cache when max - min in-flight exceeds this ..."),
    "balance_rel_threshold": (_POLICIES, "... and max in-flight exceeds this times min in-flight."),
    "local_prefill_max_tokens": (_CONDITIONAL, "Prompts of at most this many tokens (text: bytes / 4) go to a "
                                               "decode instance alone, which prefills them itself (0: off)."),
    "local_prefill_cost_factor": (_CONDITIONAL, "A longer prompt also goes to a decode instance alone when the "
                                                "least loaded prefill's queued tokens at its measured rate would "
                                                "make it wait longer than this factor times its own prefill time "
                                                "there (0: off; e.g. 2)."),
    "local_prefill_by_load": (_CONDITIONAL, "Choose local or remote prefill per request from measured load: "
                                            "predicted time to first token on the best prefill (its queue at its "
                                            "measured rate plus the handoff overhead the router learns) against "
                                            "the best decode instance's (its queue at the rate it reports it can "
                                            "prefill within its TPOT budget). Replaces the two rules above."),
    "local_prefill_alpha": (_CONDITIONAL, "--local-prefill-by-load: local wins when its prediction is below this "
                                          "times the remote one (above 1 favours the decode instances)."),
    "local_prefill_kv_gate": (_CONDITIONAL, "--local-prefill-by-load: a decode instance whose KV usage reaches "
                                            "this fraction takes no local prefill."),
    "load_poll_interval_s": (_CONDITIONAL, "Seconds between reads of the instances' /load (with a load-reading "
                                           "local-prefill rule on)."),
    "balance_roles": (_BALANCE, "Switch a PD instance (started with --enable-pd-role-switch) to the other role when "
                                "one side's pressure stays at its threshold while the other side idles; never the "
                                "last instance of a role, one switch at a time (docs/pd.md, 'Role balance')."),
    "balance_interval_s": (_BALANCE, "Seconds between reads of every instance's /load for the role balance."),
    "balance_prefill_wait_s": (_BALANCE, "A prefill is at its threshold when its queued prompt tokens take this "
                                         "many seconds at its measured rate."),
    "balance_decode_step_ms": (_BALANCE, "A decode is at its threshold when its decode step takes this many ms "
                                         "(or its KV pool is 90%% full)."),
    "balance_idle_pressure": (_BALANCE, "A side idles at this pressure or below (1: at its threshold; a decode step "
                                        "never gets far below its threshold: the weights are read at every step)."),
    "balance_window_s": (_BALANCE, "One side must stay at its threshold, the other idle, this many seconds before "
                                   "a switch."),
    "balance_cooldown_s": (_BALANCE, "Seconds after a switch before the next one."),
    "balance_drain_timeout_s": (_BALANCE, "Seconds a switching instance has to finish its requests; past them it "
                                          "refuses the switch and keeps its role (also for POST /pd_role_switch)."),
    "request_timeout_s": (_REQUESTS, "Whole-request deadline in seconds (504 when hit)."),
    "request_body_timeout_s": (_REQUESTS, "Seconds a client may take to send a request body; a slower one gets "
                                          "408 and its connection is closed."),
    "connect_timeout_s": (_REQUESTS, "Seconds to open a connection to an instance."),
    "unreachable_timeout_s": (_REQUESTS, "Seconds without any packet from an instance, TCP keep-alive answers "
                                         "included, after which its connections count as cut (a partitioned host): "
                                         "their requests fail (at least 1)."),
    "max_retries": (_REQUESTS, "Retries, each with a new pair and a new room, after a connection failure or a 5xx "
                               "that arrives before the first byte reached the client."),
    "retry_backoff_s": (_REQUESTS, "First retry backoff in seconds; doubles per retry, with jitter."),
    "retry_max_backoff_s": (_REQUESTS, "Longest retry backoff in seconds."),
    "abort_timeout_s": (_REQUESTS, "Seconds an abort_request to the other half of a failed pair may take."),
    "shutdown_drain_timeout_s": (_REQUESTS, "On SIGTERM or Ctrl-C: seconds the requests in flight get to finish "
                                            "while new ones get 503; the rest then end with an error (in-band on a "
                                            "stream). A second signal ends them at once."),
    "admin_timeout_s": (_REQUESTS, "Seconds for fan-out admin calls (/health_generate, /flush_cache, "
                                   "/get_server_info)."),
    "request_timeline_log": (_REQUESTS, "Append one JSON line per finished request to this file: its rid and the "
                                        "seconds from arrival to each stage (dispatched to and first byte from each "
                                        "side, finished), the servers' --request-timeline-log format; "
                                        "`python -m pdserve.bench.timeline` merges them."),
    "health_check_interval_s": (_HEALTH, "Seconds between health checks of every instance."),
    "health_check_timeout_s": (_HEALTH, "Seconds one health check may take."),
    "health_check_endpoint": (_HEALTH, "Path polled for health."),
    "health_failure_threshold": (_HEALTH, "Consecutive failed checks that take an instance out of rotation."),
    "health_success_threshold": (_HEALTH, "Consecutive good checks that bring it back."),
    "cb_failure_threshold": (_BREAKER, "Consecutive request failures that open an instance's circuit breaker."),
    "cb_success_threshold": (_BREAKER, "Successes in half-open state that close it again."),
    "cb_open_duration_s": (_BREAKER, "Seconds an open breaker waits before letting a probe request through."),
}
_CHOICES = {"policy": POLICIES, "prefill_policy": POLICIES, "decode_policy": POLICIES, "event_loop": EVENT_LOOPS,
            "cache_aware_source": CACHE_AWARE_SOURCES}


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve-router", description="pdserve load balancer: pairs each request "
                                     "with a prefill and a decode instance, or balances over colocated servers.")
    instances = parser.add_argument_group("instances")
    instances.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="Prefill instance URLs.")
    instances.add_argument("--prefill-bootstrap-ports", nargs="+", type=int, default=[DEFAULT_BOOTSTRAP_PORT],
                           metavar="PORT", help="One bootstrap port for all prefills, or one per prefill.")
    instances.add_argument("--decode", nargs="+", default=[], metavar="URL", help="Decode instance URLs.")
    instances.add_argument("--worker", nargs="+", default=[], metavar="URL",
                           help="Colocated (non-PD) servers: selects regular mode.")
    instances.add_argument("--mode", choices=("pd", "regular"), default=None,
                           help="Default: regular when --worker is given, else pd (instances may come later via "
                                "/workers).")
    _add_config_flags(parser)
    return parser


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per RouterConfig knob, in the group _HELP names, showing its default."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    defaults = RouterConfig.__dataclass_fields__
    for f in fields(RouterConfig):
        if f.name not in _HELP:
            continue
        group_name, help_text = _HELP[f.name]
        group = groups.get(group_name) or groups.setdefault(group_name, parser.add_argument_group(group_name))
        default = defaults[f.name].default
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(default, bool):
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                               help=help_text)
            continue
        kind = type(default) if default is not None else str
        group.add_argument(flag, dest=f.name, type=kind, default=default, choices=_CHOICES.get(f.name),
                           help=f"{help_text} (default: {default})")


def config_from_args(ns: argparse.Namespace) -> RouterConfig:
    ports = tuple(ns.prefill_bootstrap_ports)
    if len(ports) == 1:
        ports *= len(ns.prefill)
    elif len(ports) != len(ns.prefill):
        raise ConfigError(f"--prefill-bootstrap-ports takes one port or one per prefill ({len(ns.prefill)}), "
                          f"got {len(ports)}")
    if any(not 0 < p < 65536 for p in ports):
        raise ConfigError("bootstrap ports must be in 1..65535")
    mode = ns.mode or ("regular" if ns.worker else "pd")
    knobs = {name: getattr(ns, name) for name in _HELP}
    knobs["disaggregation_secret"] = configured_secret(ns.disaggregation_secret, ns.api_key)
    return RouterConfig(mode=mode, prefill_urls=tuple(ns.prefill), bootstrap_ports=ports, decode_urls=tuple(ns.decode),
                        worker_urls=tuple(ns.worker), **knobs)


def parse_config(argv: list[str] | None = None) -> RouterConfig:
    parser = build_arg_parser()
    try:
        return config_from_args(parser.parse_args(argv))
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def main(argv: list[str] | None = None) -> None:
    from .app import run

    config = parse_config(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run(config)
    except ConfigError as exc:
        build_arg_parser().error(str(exc))
