"""Mooncake Transfer Engine (one-sided WRITE) with P2P handshake metadata, no etcd.

Mooncake picks its transport from the environment, not from `initialize`'s protocol argument, and tests
the MC_* switches for presence. We choose once at start-up and log it:
  1. the user set MC_FORCE_TCP / MC_INTRANODE_NVLINK / MC_FORCE_MNNVL / MC_FORCE_HCA: respected as is;
  2. --disaggregation-ib-device given, or RDMA devices present: rdma;
  3. KV on CUDA and the build has SUPPORT_INTRA_NVLINK: nvlink_intra (CUDA IPC, same host only);
  4. otherwise tcp (host-staged inside Mooncake; CUDA memory needs a CUDA build).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from pdserve.disagg.addressing import is_wildcard
from pdserve.disagg.transfer.base import TransferEngine, TransferError
from pdserve.disagg.transfer.listen_filter import listening_fds, restrict_new_listeners

logger = logging.getLogger(__name__)

# One batch_transfer_sync_write call takes at most this many spans: mooncake-transfer-engine 0.3.13 fails a batch
# of 3000 (rc=-1, whatever the bytes) and takes 2048. A head slice moves one span per token, a scattered page
# list one per page: more in one write is common.
MAX_SPANS_PER_BATCH = 2048

IB_SYSFS = Path("/sys/class/infiniband")

# Presence-tested switches, in the order Mooncake's TransferEngineImpl::init checks them.
_USER_SWITCHES = (
    ("MC_FORCE_TCP", "tcp"),
    ("MC_INTRANODE_NVLINK", "nvlink_intra"),
    ("MC_FORCE_MNNVL", "nvlink"),
    ("MC_FORCE_HCA", "rdma"),
)


@dataclass(frozen=True, slots=True)
class MooncakeTransport:
    transport: str
    device_name: str  # initialize()'s HCA list; "" = all
    env: dict[str, str] = field(default_factory=dict)  # to set before initialize()
    reason: str = ""


def present_ib_devices(sysfs: Path = IB_SYSFS) -> list[str]:
    return sorted(p.name for p in sysfs.iterdir()) if sysfs.is_dir() else []


def select_transport(
    kv_device: str,
    ib_device: str | None,
    support_intra_nvlink: bool,
    present_ib: list[str],
    environ: Mapping[str, str],
) -> MooncakeTransport:
    if ib_device:
        missing = [d for d in ib_device.split(",") if d.strip() not in present_ib]
        if missing:
            raise TransferError(
                f"--disaggregation-ib-device {ib_device!r}: no RDMA device named {', '.join(missing)}; "
                f"present: {', '.join(present_ib) or 'none (no /sys/class/infiniband entries)'}"
            )
    for var, transport in _USER_SWITCHES:
        if var in environ:
            device_name = "" if transport == "tcp" else ib_device or ""
            return MooncakeTransport(transport, device_name, reason=f"{var} is set in the environment")
    if ib_device:
        return MooncakeTransport("rdma", ib_device, reason="--disaggregation-ib-device given")
    if present_ib:
        return MooncakeTransport("rdma", "", reason=f"RDMA devices present: {', '.join(present_ib)}")
    if kv_device.startswith("cuda") and support_intra_nvlink:
        return MooncakeTransport(
            "nvlink_intra", "", {"MC_INTRANODE_NVLINK": "1"}, "KV on CUDA, no RDMA device, build has intra-node NVLink"
        )
    return MooncakeTransport("tcp", "", {"MC_FORCE_TCP": "1"}, "no RDMA device and no intra-node NVLink for this KV")


@contextmanager
def _environment(switches: dict[str, str]):
    """Mooncake reads its switches once, in `initialize`: they are set for that call only, so that one engine's
    choice (MC_FORCE_TCP for a host-memory engine) never becomes a "user switch" for the next engine in the process
    or for the processes it spawns."""
    saved = {name: os.environ.get(name) for name in switches}
    os.environ.update(switches)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def import_mooncake():
    # Mooncake's glog lines obey its own switch, read when the library loads: only errors unless pdserve logs DEBUG
    os.environ.setdefault("MC_LOG_LEVEL", "INFO" if logger.isEnabledFor(logging.DEBUG) else "ERROR")
    try:
        import mooncake.engine as engine
    except (ImportError, OSError) as exc:
        raise TransferError(
            f"mooncake transfer engine is not usable ({exc}); install mooncake-transfer-engine "
            "(CUDA 12), mooncake-transfer-engine-cuda13 or mooncake-transfer-engine-non-cuda (host memory only), "
            "plus the OS libraries libibverbs1 librdmacm1 libnuma1"
        ) from exc
    return engine


class MooncakeTransferEngine(TransferEngine):
    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1", kv_device: str = "cpu", ib_device: str | None = None,
                 bind_host: str | None = None):
        """`host` is the address peers reach this engine at; mooncake listens on every interface, so unless
        `bind_host` is a wildcard its listeners accept only connections addressed to `bind_host` (default `host`)."""
        super().__init__()
        mc = import_mooncake()
        if kv_device.startswith("cuda") and not getattr(mc, "SUPPORT_CUDA", False):
            raise TransferError(
                "this mooncake build has no CUDA support (mooncake-transfer-engine-non-cuda?) but the KV cache "
                "is on CUDA; install mooncake-transfer-engine or mooncake-transfer-engine-cuda13"
            )
        choice = select_transport(
            kv_device, ib_device, bool(getattr(mc, "SUPPORT_INTRA_NVLINK", False)), present_ib_devices(), os.environ
        )
        self._engine = mc.TransferEngine()
        listeners_before = listening_fds()
        protocol = "rdma" if choice.transport == "rdma" else "tcp"  # only picks Mooncake's buffer allocator
        with _environment(choice.env):
            rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, choice.device_name)
        if rc != 0:
            raise TransferError(f"mooncake initialize({host!r}, P2PHANDSHAKE, {protocol}, {choice.device_name!r}) failed")
        self._transport = choice.transport
        bind_host = host if bind_host is None else bind_host
        if not is_wildcard(bind_host):
            ports = restrict_new_listeners(listeners_before, bind_host)
            logger.info("mooncake listeners on ports %s accept connections to %s only", ports, bind_host)
        self._session = f"{host}:{self._engine.get_rpc_port()}"
        logger.info("mooncake transfer engine %s uses %s (%s)", self._session, choice.transport, choice.reason)

    def session_id(self) -> str:
        return self._session

    def transport(self) -> str:
        return self._transport

    def register(self, ptr: int, length: int, device: str = "cpu") -> None:
        region = self.regions.add(ptr, length, device)
        if self._engine.register_memory(ptr, length) != 0:
            self.regions.remove(region)
            raise TransferError(f"mooncake register_memory({ptr:#x}, {length}) on {device} failed ({self._transport})")

    def write(self, peer_session: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]) -> None:
        if not self.has_spans_to_write(src_ptrs, dst_ptrs, lengths):
            return
        for start in range(0, len(lengths), MAX_SPANS_PER_BATCH):
            end = start + MAX_SPANS_PER_BATCH
            rc = self._engine.batch_transfer_sync_write(peer_session, src_ptrs[start:end], dst_ptrs[start:end],
                                                        lengths[start:end])
            if rc != 0:
                raise TransferError(
                    f"mooncake batch write of {len(lengths[start:end])} spans ({sum(lengths[start:end])} B) to "
                    f"{peer_session} over {self._transport} failed (rc={rc})"
                )

    def close(self) -> None:
        if self._engine is None:
            return
        ptrs = [r.ptr for r in self.regions]
        if ptrs:
            self._engine.batch_unregister_memory(ptrs)
        self._engine = None
