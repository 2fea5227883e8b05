"""What a PD server checks before it loads anything, so that a setup that cannot work fails in seconds with one
line naming the fix, not after the model has loaded:

- the transfer backend named on the command line can run here: mooncake imports, addresses the KV cache's memory
  and its engine starts (tried in a short-lived child process, as the scheduler would start it); nccl has a GPU;
- a server other hosts can reach (`--host` not a loopback address) has a cluster secret, or anyone who reaches
  its bootstrap server, control channel or KV port can register ranks and write into its KV cache.
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import sys

from pdserve.cluster_auth import SECRET_ENV, cluster_secret
from pdserve.config import ConfigError, ServerArgs

MOONCAKE_PROBE_TIMEOUT_S = 60.0
USE_TCP = "or use --disaggregation-transfer-backend tcp"
# Run in a child: a mooncake engine keeps threads and listeners for the life of its process.
_MOONCAKE_PROBE = """
import sys
from pdserve.disagg.addressing import announced_host
from pdserve.disagg.transfer.base import TransferError
from pdserve.disagg.transfer.mooncake import MooncakeTransferEngine
bind_host, advertise_host, device, ib_device = sys.argv[1:]
try:
    MooncakeTransferEngine(announced_host(bind_host, advertise_host or None), device, ib_device or None,
                           bind_host=bind_host)
except TransferError as exc:
    print(exc, file=sys.stderr)
    sys.exit(3)
"""


def check_before_loading(args: ServerArgs) -> None:
    """ConfigError when this PD server could not serve; nothing for a colocated one."""
    if not args.is_pd:
        return
    check_secure_bind(args)
    check_transfer_backend(args)


def check_secure_bind(args: ServerArgs) -> None:
    if is_loopback(args.host) or cluster_secret(args.disaggregation_secret, args.api_key):
        return
    raise ConfigError(
        f"a PD server bound to {args.host or 'every interface'} is reachable from other hosts and needs a cluster "
        f"secret: set {SECRET_ENV} (the same for prefill, decode and router), or give --disaggregation-secret or "
        "--api-key; or bind --host 127.0.0.1")


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one (a wildcard names every interface)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    if not host:
        return False
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False  # the server will fail to bind it anyway
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def check_transfer_backend(args: ServerArgs) -> None:
    backend = args.disaggregation_transfer_backend
    if backend == "mooncake":
        probe_mooncake(args, kv_device(args))
    elif backend == "nccl" and kv_device(args) != "cuda":
        raise ConfigError(f"--disaggregation-transfer-backend nccl moves the KV cache between GPUs and this server "
                          f"runs on the CPU; {USE_TCP.removeprefix('or ')}")


def kv_device(args: ServerArgs) -> str:
    """cuda or cpu: where the KV cache will live."""
    if args.device != "auto":
        return args.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def probe_mooncake(args: ServerArgs, device: str) -> None:
    """ConfigError unless a mooncake engine starts here as the scheduler would start it for a KV cache on
    `device`."""
    argv = [sys.executable, "-c", _MOONCAKE_PROBE, args.host, args.disaggregation_advertise_host or "", device,
            args.disaggregation_ib_device or ""]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=MOONCAKE_PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"the mooncake transfer engine did not start within {MOONCAKE_PROBE_TIMEOUT_S:g} s; "
                          f"{USE_TCP}") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
        raise ConfigError(f"--disaggregation-transfer-backend mooncake cannot run here: {lines[-1]}; {USE_TCP}")
