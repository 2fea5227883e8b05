"""Command line: mini_lb's flags (`--prefill`, `--prefill-bootstrap-ports`, `--decode`) plus regular mode and knobs."""

from __future__ import annotations

import argparse
import logging
from dataclasses import fields

from .cluster_auth import configured_secret
from .config import CACHE_AWARE_SOURCES, DEFAULT_BOOTSTRAP_PORT, EVENT_LOOPS, POLICIES, ConfigError, RouterConfig


_HELP: dict[str, str] = {
    "host": "Address to bind; 127.0.0.1 unless told otherwise.",
    "port": "HTTP port.",
    "api_key": "Sent to every instance as 'Authorization: Bearer KEY' and required from clients on all routes "
               "but /health.",
    "disaggregation_secret": "Cluster secret shared with the PD servers (or env PDSERVE_DISAGGREGATION_SECRET): "
                             "signs each request's bootstrap fields so the servers accept them only from the router.",
    "log_level": "debug, info, warning or error.",
    "event_loop": "auto: uvloop when it is installed (pip install 'pdserve-router[fast]'), else asyncio; uvloop: "
                  "require it; asyncio: the standard loop even when uvloop is installed.",
    "policy": "Regular-mode policy.",
    "prefill_policy": "PD-mode policy for prefill instances.",
    "decode_policy": "PD-mode policy for decode instances.",
    "cache_threshold": "cache_aware: fraction of the prompt a known prefix must cover to win.",
    "cache_block_chars": "cache_aware: prefix granularity in characters (or token ids).",
    "cache_max_entries": "cache_aware: most prefix blocks remembered (LRU).",
    "cache_aware_source": "cache_aware: where prefixes are known from: local (the router's own index of where it "
                          "sent each prefix, like SGLang's router), reported (each instance's /cache_report of the "
                          "prefix blocks it holds per tier), or both (the longer match).",
    "cache_report_interval_s": "cache_aware with reported/both: seconds between reads of each instance's "
                               "/cache_report.",
    "cache_report_ttl_s": "cache_aware with reported/both: a report older than this many seconds is ignored.",
    "balance_abs_threshold": "cache_aware: ignore the cache when max - min in-flight exceeds this ...",
    "balance_rel_threshold": "... and max in-flight exceeds this times min in-flight.",
    "local_prefill_max_tokens": "Conditional disaggregation: prompts of at most this many tokens (text: bytes / 4) "
                                "go to a decode instance alone, which prefills them itself (0: off).",
    "local_prefill_cost_factor": "Conditional disaggregation: a longer prompt also goes to a decode instance alone "
                                 "when the least loaded prefill's queued tokens at its measured rate would make it "
                                 "wait longer than this factor times its own prefill time there (0: off; e.g. 2).",
    "load_poll_interval_s": "Seconds between reads of each prefill's /load (with a local-prefill rule on).",
    "request_timeout_s": "Whole-request deadline in seconds (504 when hit).",
    "connect_timeout_s": "Seconds to open a connection to an instance.",
    "unreachable_timeout_s": "Seconds without any packet from an instance, TCP keep-alive answers included, after "
                             "which its connections count as cut (a partitioned host): their requests fail (at least 1).",
    "max_retries": "Retries, each with a new pair and a new room, after a connection failure or a 5xx that "
                   "arrives before the first byte reached the client.",
    "retry_backoff_s": "First retry backoff in seconds; doubles per retry, with jitter.",
    "retry_max_backoff_s": "Longest retry backoff in seconds.",
    "abort_timeout_s": "Seconds an abort_request to the other half of a failed pair may take.",
    "shutdown_drain_timeout_s": "On SIGTERM or Ctrl-C: seconds the requests in flight get to finish while new ones get "
                                "503; the rest then end with an error (in-band on a stream). A second signal ends "
                                "them at once.",
    "admin_timeout_s": "Seconds for fan-out admin calls (/health_generate, /flush_cache, /get_server_info).",
    "request_timeline_log": "Append one JSON line per finished request to this file: its rid and the seconds from "
                            "arrival to each stage (dispatched to and first byte from each side, finished), the "
                            "servers' --request-timeline-log format; `python -m pdserve.bench.timeline` merges them.",
    "health_check_interval_s": "Seconds between health checks of every instance.",
    "health_check_timeout_s": "Seconds one health check may take.",
    "health_check_endpoint": "Path polled for health.",
    "health_failure_threshold": "Consecutive failed checks that take an instance out of rotation.",
    "health_success_threshold": "Consecutive good checks that bring it back.",
    "cb_failure_threshold": "Consecutive request failures that open an instance's circuit breaker.",
    "cb_success_threshold": "Successes in half-open state that close it again.",
    "cb_open_duration_s": "Seconds an open breaker waits before letting a probe request through.",
}
_CHOICES = {"policy": POLICIES, "prefill_policy": POLICIES, "decode_policy": POLICIES, "event_loop": EVENT_LOOPS,
            "cache_aware_source": CACHE_AWARE_SOURCES}


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve-router", description="pdserve load balancer: pairs each request "
                                     "with a prefill and a decode instance, or balances over colocated servers.")
    parser.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="Prefill instance URLs.")
    parser.add_argument("--prefill-bootstrap-ports", nargs="+", type=int, default=[DEFAULT_BOOTSTRAP_PORT],
                        metavar="PORT", help="One bootstrap port for all prefills, or one per prefill.")
    parser.add_argument("--decode", nargs="+", default=[], metavar="URL", help="Decode instance URLs.")
    parser.add_argument("--worker", nargs="+", default=[], metavar="URL",
                        help="Colocated (non-PD) servers: selects regular mode.")
    parser.add_argument("--mode", choices=("pd", "regular"), default=None,
                        help="Default: regular when --worker is given, else pd (instances may come later via "
                             "/workers).")
    defaults = RouterConfig.__dataclass_fields__
    for f in fields(RouterConfig):
        if f.name not in _HELP:
            continue
        default = defaults[f.name].default
        kind = type(default) if default is not None else str
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=kind, default=default,
                            choices=_CHOICES.get(f.name), help=f"{_HELP[f.name]} (default: {default})")
    return parser


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
    knobs["disaggregation_secret"] = configured_secret(ns.disaggregation_secret)
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
