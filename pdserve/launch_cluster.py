"""`python -m pdserve.launch_cluster`: a router plus N prefill and M decode servers on this machine, one command.

    python -m pdserve.launch_cluster                                   # 1 prefill + 1 decode, a tiny model
    python -m pdserve.launch_cluster --model-path DIR --prefill 2 --decode 2 -- --max-total-tokens 8192  # 2P2D
    python -m pdserve.launch_cluster --colocated --num-workers 2       # baseline: regular router, no PD
    python -m pdserve.launch_cluster --model-path DIR --num-gpus 4 --layout auto --workload mix  # the measured best

Without server counts (`--prefill`, `--decode`, `--colocated`, `--num-workers`), the `--layout` starts: `auto`
(default) picks the layout measured best for `--workload` on the GPUs (`pdserve.layouts`; on the CPU or one GPU,
1 prefill + 1 decode as always) and says which and why in one line; `colocated`, `XpYd`, `XpYd-balanced` and the
`-roles` ending (roles that follow the load) name one.

Each server takes as many GPUs as its TP size, prefills first: with `--prefill-tp-size 2 --decode-tp-size 1`,
prefill 0 runs on GPUs 0-1, prefill 1 on GPUs 2-3, decode 0 on GPU 4 (each server's `--base-gpu-id`, and its own
`--nccl-port` for its ranks to meet on); with no GPU everything runs on the CPU, one process per rank. On a machine
with one GPU, servers of one rank each share it: they start one after another, each with a `--mem-fraction-static`
that counts the memory of the ones before it (`place_servers`).
Every server and the router is a child process in its own session, logging to a file under `--log-dir`.
The launcher waits until each server's and then the router's /health answers, prints the router URL and a
curl line, and stops everything on Ctrl-C/SIGTERM: the router and the servers drain (new requests get 503, those
in flight get `--shutdown-drain-timeout-s` to finish, the rest end with an error); a second Ctrl-C stops them at
once. If a child dies, it says which and stops the rest (exit 1).
Every child runs with one cluster secret (PDSERVE_DISAGGREGATION_SECRET in its environment): the one given
(`--disaggregation-secret` or `--api-key` after `--`, or the environment's), else a new `secrets.token_urlsafe`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.cluster_auth import SECRET_ENV, cluster_secret
from pdserve.config import ConfigError, ServerArgs, build_arg_parser as build_server_arg_parser, parse_server_cli
from pdserve.hub import resolve_model_path
from pdserve.layouts import (BALANCED_ROUTER_FLAGS, DECODE_TPOT_BUDGET_FLAG, ROLE_BALANCE_ROUTER_FLAGS,
                             ROLE_SWITCH_SERVER_FLAG, WORKLOADS, LayoutError, check_fits, check_layout_name,
                             choose_layout, parse_layout, plain_layout)
from pdserve.ports import free_port
from pdserve.server_processes import (TERMINATE_TIMEOUT_SECONDS, ClusterError, Proc, decode_flags, http_url,
                                      pd_router_flags, prefill_flags, router_argv, server_argv, stop_all, wait_healthy)

WATCH_POLL_SECONDS = 0.5
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG_ERROR = 2  # argparse's own code for a bad command line
PROG = "pdserve-cluster"
EXAMPLE_PROMPT = "The capital of France is"
BACKENDS = ("auto", "mooncake", "nccl", "tcp")  # fake serves each role alone (docs/pd.md): no cluster
# Servers sharing one GPU: the part of --mem-fraction-static given up for each server after the first, for its own
# CUDA context, activations and graphs (one server alone keeps the whole 1 - fraction for those).
SHARED_GPU_RUNTIME_FRACTION = 0.05
CPU_SLOTS = 2  # the servers a layout places on the CPU without --num-gpus


@dataclass(frozen=True, slots=True)
class ChildSpec:
    name: str  # "prefill 0", "decode 1", "worker 0", "router"
    argv: tuple[str, ...]
    url: str  # where /health answers
    gpu: int | None = None  # the first of its GPUs
    bootstrap_port: int | None = None
    tp_size: int = 1


# ---- command line ---------------------------------------------------------------------------------------------


class LaunchConfigError(ValueError):
    """A bad flag, flag value or model path: reported as one line, before anything starts."""


class OneLineErrorParser(argparse.ArgumentParser):
    """Reports a bad command line as a LaunchConfigError instead of printing the usage and exiting."""

    def error(self, message: str):
        raise LaunchConfigError(message)


def build_arg_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="python -m pdserve.launch_cluster",
        description="Start a pdserve router with prefill and decode servers (or colocated workers) on this machine. "
                    "Flags after `--` go to every server, e.g. `-- --max-total-tokens 8192 --page-size 16`.",
    )
    parser.add_argument("--model-path", default=None,
                        help="HF-format model folder; default: a tiny random-weight qwen3 model built once and cached.")
    parser.add_argument("--num-prefill", "--prefill", type=int, default=None,
                        help="Prefill servers (default: 1, or as --layout says when no server count is given).")
    parser.add_argument("--num-decode", "--decode", type=int, default=None, help="Decode servers (default: 1).")
    parser.add_argument("--colocated", action="store_true",
                        help="Baseline without PD: --num-workers colocated servers behind a regular-mode router.")
    parser.add_argument("--num-workers", type=int, default=None,
                        help="Colocated servers with --colocated (default: 1).")
    parser.add_argument("--layout", type=layout_name, default="auto",
                        help="Without server counts: auto (default: the layout measured best for --workload on the "
                             "GPUs, 1 prefill + 1 decode on the CPU or one GPU), colocated (one server per GPU), "
                             "XpYd (e.g. 1p3d), XpYd-balanced (decode servers also prefill, within "
                             "--decode-tpot-budget-ms, when the router finds the prefill queue long), and a PD "
                             "layout ending in -roles (servers switch role when one side idles and the other "
                             "queues).")
    parser.add_argument("--num-gpus", type=int, default=None,
                        help="GPUs a layout uses, the first ones visible (default: all; on the CPU, the servers a "
                             f"layout places, default {CPU_SLOTS}).")
    parser.add_argument("--workload", choices=WORKLOADS, default="mix",
                        help="What --layout auto chooses for: mix (70%% chat, 30%% long documents), chat, docs.")
    parser.add_argument("--decode-tpot-budget-ms", type=float, default=8.5,
                        help="-balanced layouts: the time per output token a decode server keeps while it prefills "
                             "(default: 8.5, a margin under a 10 ms TPOT SLO; measured so on H200s).")
    parser.add_argument("--prefill-tp-size", type=int, default=None,
                        help="Tensor-parallel ranks of each prefill server (default: --tp-size after `--`, else 1).")
    parser.add_argument("--decode-tp-size", type=int, default=None,
                        help="Tensor-parallel ranks of each decode server (default: --tp-size after `--`, else 1).")
    parser.add_argument("--transfer-backend", choices=BACKENDS, default="auto",
                        help="KV transfer backend of the PD servers (default: auto: mooncake if usable, else tcp).")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: one GPU per server when CUDA is present, else the CPU.")
    parser.add_argument("--host", default="127.0.0.1", help="Address every server and the router bind.")
    parser.add_argument("--port", type=int, default=0, help="Router port (default: a free one).")
    parser.add_argument("--router-args", default="",
                        help="Extra router flags in one string, e.g. \"--decode-policy round_robin\".")
    parser.add_argument("--log-dir", default=None, help="Where the children's logs go (default: a new temp dir).")
    parser.add_argument("--startup-timeout", type=float, default=1800.0,
                        help="Seconds to wait for every server and the router to become healthy.")
    parser.add_argument("--shutdown-drain-timeout-s", type=float, default=30.0,
                        help="On Ctrl-C: seconds the requests in flight get to finish before they end with an error; "
                             "a second Ctrl-C stops at once (default: 30).")
    return parser


def layout_name(value: str) -> str:
    if value == "auto":
        return value
    try:
        return check_layout_name(value)
    except LayoutError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def split_engine_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """The flags before `--`, and the server flags after it."""
    if "--" not in argv:
        return argv, []
    split = argv.index("--")
    return argv[:split], argv[split + 1 :]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's flags, and the engine flags after `--` (passed to every server as they are)."""
    argv, engine_args = split_engine_args(argv)
    parser = build_arg_parser()
    ns = parser.parse_args(argv)
    counts = {"--num-prefill": ns.num_prefill, "--num-decode": ns.num_decode, "--num-workers": ns.num_workers,
              "--prefill-tp-size": ns.prefill_tp_size, "--decode-tp-size": ns.decode_tp_size,
              "--num-gpus": ns.num_gpus}
    for flag, value in counts.items():
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if ns.decode_tpot_budget_ms <= 0:
        parser.error(f"--decode-tpot-budget-ms must be positive, got {ns.decode_tpot_budget_ms:g}")
    ns.server_counts_given = ns.colocated or any(n is not None for n in (ns.num_prefill, ns.num_decode,
                                                                         ns.num_workers))
    if ns.server_counts_given and ns.layout != "auto":
        parser.error(f"--layout {ns.layout} names the servers itself; leave out --prefill, --decode, --colocated "
                     "and --num-workers")
    ns.num_prefill, ns.num_decode, ns.num_workers = ns.num_prefill or 1, ns.num_decode or 1, ns.num_workers or 1
    ns.balanced = ns.switch_roles = False
    if not 0 <= ns.port < 65536:
        parser.error(f"--port must be in 0..65535, got {ns.port}")
    owned = ("--model-path", "--model", "--port", "--host", "--device", "--base-gpu-id", "--disaggregation-mode",
             "--disaggregation-bootstrap-port", "--disaggregation-transfer-backend", "--nccl-port",
             "--shutdown-drain-timeout-s")
    clash = sorted({a.split("=")[0] for a in engine_args} & set(owned))
    if clash:
        parser.error(f"{', '.join(clash)} after `--` would override what the cluster launcher sets; "
                     "use the launcher's own flags (--model-path, --host, --device, --transfer-backend)")
    if ns.model_path is not None:
        check_model_path(ns.model_path)
    ns.engine = check_engine_args(ns.model_path or "unchecked", engine_args)
    engine_tp = ns.engine.tp_size
    ns.prefill_tp_size, ns.decode_tp_size = ns.prefill_tp_size or engine_tp, ns.decode_tp_size or engine_tp
    ns.worker_tp_size = engine_tp
    ns.cluster_secret = cluster_secret(ns.engine.disaggregation_secret, ns.engine.api_key) or secrets.token_urlsafe(32)
    return ns, engine_args


def check_model_path(path: str) -> None:
    try:
        path = resolve_model_path(path)
    except ConfigError as exc:
        raise LaunchConfigError(f"--model-path: {exc}") from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise LaunchConfigError(f"--model-path {path}: no config.json there (an HF-format model folder is needed)")


def check_engine_args(model_path: str, engine_args: list[str]) -> ServerArgs:
    """The flags after `--` as every server will parse them, so that a bad one fails here and not in N servers."""
    try:
        return parse_server_cli(build_server_arg_parser(), ["--model-path", model_path, *engine_args])[1]
    except ConfigError as exc:
        raise LaunchConfigError(f"after `--`: {exc}") from exc


# ---- planning -------------------------------------------------------------------------------------------------


class PortPicker:
    """Free TCP ports on `host` (`free_port` never hands out the same one twice in a process)."""

    def __init__(self, host: str):
        self.host = host

    def pick(self) -> int:
        return free_port(self.host)


def reachable_host(bind_host: str) -> str:
    """The address the router and the decode servers use to reach a server bound on `bind_host`."""
    if bind_host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if bind_host == "::":
        return "::1"
    return bind_host


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the servers run, in plan order (prefills, then decodes; or the workers)."""
    device: str  # cuda or cpu
    first_gpus: tuple[int | None, ...]  # each server's first GPU (None on the CPU)
    memory_flags: tuple[tuple[str, ...], ...]  # each server's own memory flags (they follow the flags after `--`)
    one_by_one: bool = False  # start each server once the one before it is healthy (its memory is then in use)
    note: str | None = None  # the line that says how the GPU is shared


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def place_servers(device: str, gpus: int, tp_sizes: Sequence[int], engine: ServerArgs) -> Placement:
    """The placement of servers with `tp_sizes` ranks each on `gpus` visible GPUs, for `--device` `device` and the
    flags after `--` (`engine`): one GPU per rank in order when there are enough; every server on the one GPU when
    there is one and each server has one rank; else a ClusterError."""
    cpu = Placement("cpu", (None,) * len(tp_sizes), ((),) * len(tp_sizes))
    if device == "cpu":
        return cpu
    if gpus == 0:
        if device == "cuda":
            raise ClusterError("--device cuda was given but no CUDA device is visible")
        return cpu
    needed = sum(tp_sizes)
    if gpus >= needed:
        firsts = tuple(sum(tp_sizes[:i]) for i in range(len(tp_sizes)))
        return Placement("cuda", firsts, ((),) * len(tp_sizes))
    if gpus == 1 and max(tp_sizes) == 1:
        return share_one_gpu(len(tp_sizes), engine)
    raise ClusterError(f"the servers need {needed} GPUs (one per tensor-parallel rank) but {gpus} are visible; "
                       "start fewer servers or ranks, or use --device cpu")


def share_one_gpu(servers: int, engine: ServerArgs) -> Placement:
    """`servers` one-rank servers on GPU 0. With --max-total-tokens after `--` each takes that many KV tokens;
    otherwise --mem-fraction-static (given or default) less the other servers' runtime room is split evenly, and
    server k gets the cumulative fraction (k + 1) / servers of it: its own share plus what the k servers started
    before it already use (a server's KV budget is the fraction of the GPU minus the memory in use when it starts)."""
    if engine.max_total_tokens is not None:
        return Placement("cuda", (0,) * servers, ((),) * servers, note=f"one GPU: {servers} servers share GPU 0, "
                         f"each with the --max-total-tokens {engine.max_total_tokens} given after `--`")
    usable = engine.mem_fraction_static - SHARED_GPU_RUNTIME_FRACTION * (servers - 1)
    if usable <= 0:
        raise ClusterError(f"{servers} servers cannot share one GPU at --mem-fraction-static "
                           f"{engine.mem_fraction_static}; start fewer servers or give --max-total-tokens")
    fractions = [f"{usable * (k + 1) / servers:.3f}" for k in range(servers)]
    return Placement("cuda", (0,) * servers, tuple(("--mem-fraction-static", f) for f in fractions), one_by_one=True,
                     note=f"one GPU: {servers} servers share GPU 0, started one after another with "
                          f"--mem-fraction-static {', '.join(fractions)} (each counts the memory of those before it)")


def server_tp_sizes(ns: argparse.Namespace) -> list[int]:
    """Each server's TP size, in plan order."""
    if ns.colocated:
        return [ns.worker_tp_size] * ns.num_workers
    return [ns.prefill_tp_size] * ns.num_prefill + [ns.decode_tp_size] * ns.num_decode


def layout_gpus(ns: argparse.Namespace, visible: int) -> int:
    """The GPUs the cluster may use: --num-gpus of the `visible` ones (all by default); 0 on the CPU."""
    if visible and ns.num_gpus is not None and ns.num_gpus > visible:
        raise ClusterError(f"--num-gpus {ns.num_gpus} but {visible} GPU(s) are visible")
    return min(visible, ns.num_gpus or visible)


def auto_layout(workload: str, servers: int, tp_size: int) -> tuple[str, str]:
    """`choose_layout` for `servers` server slots; with ranks per server, its plain form (no -balanced, -roles)."""
    name, why = choose_layout(workload, servers)
    if tp_size == 1:
        return name, why
    return plain_layout(name), f"{why}; plain, as servers of {tp_size} ranks take no TPOT budget or role switch"


def apply_layout(ns: argparse.Namespace, gpus: int) -> str | None:
    """Set the server counts of `ns` from its --layout on `gpus` GPUs (0: the CPU), and return the line that says
    which layout and why; None when the command line gave the server counts itself."""
    if ns.server_counts_given:
        return None
    slots = gpus or ns.num_gpus or CPU_SLOTS
    tp_size = max(ns.prefill_tp_size, ns.decode_tp_size)
    name, why = (ns.layout, "") if ns.layout != "auto" else auto_layout(ns.workload, gpus // tp_size, tp_size)
    try:
        layout = parse_layout(name, slots)
        check_fits(layout, gpus if tp_size == 1 else 0)  # servers of several ranks: place_servers counts them
    except LayoutError as exc:
        raise ClusterError(str(exc)) from None
    if tp_size > 1 and (layout.balanced or layout.switch_roles):
        raise ClusterError(f"layout {name}: the TPOT budget and the role switch need servers of one rank "
                           "(--tp-size 1); name the plain layout")
    ns.colocated, ns.balanced, ns.switch_roles = layout.colocated, layout.balanced, layout.switch_roles
    ns.num_workers = max(1, layout.workers // ns.worker_tp_size)
    ns.num_prefill, ns.num_decode = layout.prefill or 1, layout.decode or 1
    where = f"{gpus} GPU{'s' if gpus > 1 else ''}" if gpus else "the CPU"
    if ns.layout != "auto":
        return f"--layout {name} on {where}: {layout.describe()}"
    return f"--layout auto on {where} for the {ns.workload} workload: {name} ({layout.describe()}); {why}"


def pd_servers(ns: argparse.Namespace, spec: Callable[..., ChildSpec], ports: PortPicker
               ) -> tuple[list[ChildSpec], list[str]]:
    """The prefill then decode servers (`spec(name, tp_size, *flags, bootstrap=port)` plans one), and the router's
    flags for them. A -balanced layout's decodes prefill within their TPOT budget and its router picks the path by
    load; in a -roles layout every server may switch role (a decode has a bootstrap port of its own for when it
    prefills, a balanced prefill the TPOT budget for when it decodes) and the router balances the roles."""
    switch = [ROLE_SWITCH_SERVER_FLAG] if ns.switch_roles else []
    budget = [DECODE_TPOT_BUDGET_FLAG, f"{ns.decode_tpot_budget_ms:g}"] if ns.balanced else []
    prefills = []
    for i in range(ns.num_prefill):
        boot = ports.pick()
        prefills.append(spec(f"prefill {i}", ns.prefill_tp_size, *prefill_flags(ns.transfer_backend, boot), *switch,
                             *(budget if switch else []), bootstrap=boot))
    decodes = []
    for j in range(ns.num_decode):
        boot = ports.pick() if ns.switch_roles else None
        own_boot = ["--disaggregation-bootstrap-port", str(boot)] if boot else []
        decodes.append(spec(f"decode {j}", ns.decode_tp_size, *decode_flags(ns.transfer_backend), *budget, *switch,
                            *own_boot, bootstrap=boot))
    router_flags = pd_router_flags([(s.url, s.bootstrap_port) for s in prefills], [s.url for s in decodes])
    router_flags += [*(BALANCED_ROUTER_FLAGS if ns.balanced else ()), *(ROLE_BALANCE_ROUTER_FLAGS if switch else ())]
    return prefills + decodes, router_flags


def plan_cluster(ns: argparse.Namespace, model_path: str, placement: Placement, engine_args: list[str],
                 ports: PortPicker) -> tuple[list[ChildSpec], ChildSpec]:
    """The servers to start, then the router that goes in front of them."""
    host, reach = ns.host, reachable_host(ns.host)
    places = iter(zip(placement.first_gpus, placement.memory_flags))

    def spec(name: str, tp_size: int, *role_flags: str, bootstrap: int | None = None) -> ChildSpec:
        port = ports.pick()
        gpu, memory_flags = next(places)
        tp_flags = ["--tp-size", str(tp_size), *(["--nccl-port", str(ports.pick())] if tp_size > 1 else [])]
        argv = server_argv(model_path, port, *engine_args, *role_flags, *tp_flags, *memory_flags, host=host,
                           device=placement.device, gpu=gpu)
        return ChildSpec(name, tuple(argv), http_url(reach, port), gpu, bootstrap, tp_size)

    engine_args = [*engine_args, "--shutdown-drain-timeout-s", str(ns.shutdown_drain_timeout_s)]
    if ns.colocated:
        servers = [spec(f"worker {i}", ns.worker_tp_size) for i in range(ns.num_workers)]
        router_flags = ["--worker", *(s.url for s in servers)]
    else:
        servers, router_flags = pd_servers(ns, spec, ports)
    router_port = ns.port or ports.pick()
    argv = router_argv(router_port, *router_flags, "--shutdown-drain-timeout-s", str(ns.shutdown_drain_timeout_s),
                       *ns.router_args.split(), host=host)
    return servers, ChildSpec("router", tuple(argv), http_url(reach, router_port))


# ---- running --------------------------------------------------------------------------------------------------


class Cluster:
    def __init__(self, log_dir: str, drain_timeout_s: float, secret: str):
        self.log_dir = log_dir
        self.drain_timeout_s = drain_timeout_s
        self.env = {**os.environ, SECRET_ENV: secret}  # every child's cluster secret, kept off the command lines
        self.children: list[Proc] = []
        self.stop_requested = threading.Event()
        self.stopping = False

    def start(self, specs: list[ChildSpec], deadline: float, one_by_one: bool = False) -> list[Proc]:
        """Launch the children (with `one_by_one`, each once the one before it is healthy), and wait until each
        answers /health, with a line for each one that does."""
        procs = [Proc(s.name, list(s.argv), s.url, log_path=self.log_path(s.name), env=self.env) for s in specs]
        started, ready = time.monotonic(), iter(range(1, len(procs) + 1))

        def report(proc: Proc) -> None:
            print(f"{PROG}: {proc.name} ready after {time.monotonic() - started:.0f} s "
                  f"({next(ready)}/{len(procs)})", flush=True)

        for batch in ([p] for p in procs) if one_by_one else [procs]:
            for proc in batch:
                self.children.append(proc.launch())
            wait_healthy(batch, deadline, self.stop_requested.is_set, report)
        return procs

    def log_path(self, name: str) -> str:
        return os.path.join(self.log_dir, name.replace(" ", "-") + ".log")

    def watch(self) -> None:
        """Until a stop is requested; raises ClusterError as soon as a child dies."""
        while not self.stop_requested.wait(WATCH_POLL_SECONDS):
            for child in self.children:
                child.check_alive()

    def stop(self) -> None:
        """SIGTERM to every child (each drains its requests in flight), wait, then SIGKILL whatever is left of each
        child's session."""
        self.stopping = True
        if any(child.proc is not None and child.proc.poll() is None for child in self.children):
            print(f"{PROG}: draining the requests in flight, up to {self.drain_timeout_s:g} s "
                  "(Ctrl-C again to stop now)", flush=True)
        stop_all(reversed(self.children), self.drain_timeout_s + TERMINATE_TIMEOUT_SECONDS)

    def stop_now(self) -> None:
        """A second SIGTERM to every child: each ends its requests in flight at once."""
        print(f"{PROG}: stopping now", flush=True)
        for child in self.children:
            child.terminate()


def default_model_path() -> str:
    from pdserve.tools.make_model import default_model_dir

    print(f"{PROG}: no --model-path; using the tiny random-weight qwen3 model (built once, cached)",
          flush=True)
    return str(default_model_dir("qwen3-tiny"))


def curl_line(router_url: str) -> str:
    body = json.dumps({"text": EXAMPLE_PROMPT, "max_new_tokens": 32, "temperature": 0})
    return f"curl -X POST {router_url}/generate -H \"Content-Type: application/json\" -d '{body}'"


def structured_output_state(engine: ServerArgs) -> str:
    """Whether the servers will take grammar requests (response_format, tool_choice required or named)."""
    if engine.grammar_backend == "none":
        return "off (--grammar-backend none)"
    if importlib.util.find_spec("xgrammar") is None:
        return "off (xgrammar is not installed: pip install -e . in the pdserve checkout installs it)"
    return "on (xgrammar)"


def describe(ns: argparse.Namespace, device: str, specs: list[ChildSpec], procs: list[Proc]) -> str:
    """The children as planned (`specs`, the router last) and where each one logs, the model and whether structured
    output is on."""
    mode = (f"colocated: {ns.num_workers} worker(s)" if ns.colocated else
            f"PD: {ns.num_prefill} prefill, {ns.num_decode} decode, transfer backend {ns.transfer_backend}")
    lines = [f"pdserve cluster ready ({mode}, on {device})"]
    for spec, proc in zip(specs, procs):
        where = f"TP {spec.tp_size}" if spec.tp_size > 1 else ""
        if spec.gpu is not None:
            where = f"GPU {spec.gpu}" if spec.tp_size == 1 else f"GPUs {spec.gpu}-{spec.gpu + spec.tp_size - 1}"
        boot = f"bootstrap port {spec.bootstrap_port}" if spec.bootstrap_port is not None else ""
        extras = ", ".join(x for x in (boot, where) if x)
        lines.append(f"  {spec.name:<10} {spec.url}{f'  ({extras})' if extras else ''}  log: {proc.log_path}")
    router_url = specs[-1].url
    lines += [f"Model: {ns.model_path}  (a client counting tokens loads its tokenizer from here)",
              f"Structured output: {structured_output_state(ns.engine)}"]
    lines += ["", f"Router: {router_url}", "Try:", f"  {curl_line(router_url)}", "",
              "Ctrl-C stops everything."]
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class ClusterPlan:
    layout_line: str | None  # which layout and why, when --layout chose the servers
    placement: Placement
    servers: list[ChildSpec]
    router: ChildSpec


def plan_layout(ns: argparse.Namespace, engine_args: list[str], visible: int) -> ClusterPlan:
    """The layout (`apply_layout`) on `visible` GPUs (0: none), its placement, and the children's command lines."""
    gpus = layout_gpus(ns, 0 if ns.device == "cpu" else visible)
    layout_line = apply_layout(ns, gpus)
    placement = place_servers(ns.device, gpus, server_tp_sizes(ns), ns.engine)
    ns.model_path = ns.model_path or default_model_path()
    servers, router = plan_cluster(ns, ns.model_path, placement, engine_args, PortPicker(ns.host))
    return ClusterPlan(layout_line, placement, servers, router)


@dataclass(frozen=True, slots=True)
class StartedCluster:
    device: str
    specs: list[ChildSpec]  # the servers as planned, then the router
    procs: list[Proc]  # in the same order
    layout_line: str | None = None

    @property
    def router_url(self) -> str:
        return self.specs[-1].url

    @property
    def server_urls(self) -> list[str]:
        return [spec.url for spec in self.specs[:-1]]


def start_cluster(ns: argparse.Namespace, engine_args: list[str], cluster: Cluster) -> StartedCluster:
    """Plan the cluster on the visible GPUs (`plan_layout`), start the servers, then the router; ClusterError when
    one does not become healthy (`cluster.stop` stops whatever started)."""
    plan = plan_layout(ns, engine_args, 0 if ns.device == "cpu" else visible_gpus())
    for note in (plan.layout_line, plan.placement.note):
        if note:
            print(f"{PROG}: {note}", flush=True)
    deadline = time.monotonic() + ns.startup_timeout
    print(f"{PROG}: starting {len(plan.servers)} server(s) on {plan.placement.device}; logs in {cluster.log_dir}",
          flush=True)
    servers = cluster.start(plan.servers, deadline, plan.placement.one_by_one)
    router = cluster.start([plan.router], deadline)  # after the servers, so its first health check passes
    return StartedCluster(plan.placement.device, [*plan.servers, plan.router], [*servers, *router], plan.layout_line)


def run(ns: argparse.Namespace, engine_args: list[str]) -> int:
    log_dir = ns.log_dir or tempfile.mkdtemp(prefix="pdserve-cluster-")
    os.makedirs(log_dir, exist_ok=True)
    cluster = Cluster(log_dir, ns.shutdown_drain_timeout_s, ns.cluster_secret)

    def on_signal(signum: int, frame) -> None:
        if cluster.stopping:
            cluster.stop_now()
        cluster.stop_requested.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        started = start_cluster(ns, engine_args, cluster)
        print(describe(ns, started.device, started.specs, started.procs), flush=True)
        cluster.watch()
        print(f"{PROG}: stopping", flush=True)
        return EXIT_OK
    except ClusterError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr, flush=True)
        print(f"{PROG}: stopping everything", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    try:
        ns, engine_args = parse_args(sys.argv[1:] if argv is None else argv)
    except LaunchConfigError as exc:
        print(f"{PROG}: error: {exc} (--help lists the flags)", file=sys.stderr, flush=True)
        return EXIT_CONFIG_ERROR
    return run(ns, engine_args)


if __name__ == "__main__":
    sys.exit(main())
