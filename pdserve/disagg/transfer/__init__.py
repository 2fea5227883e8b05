"""KV transfer engines for PD disaggregation and the factory that picks one."""

from __future__ import annotations

import logging

from pdserve.cluster_auth import ClusterAuth
from pdserve.disagg.transfer.base import (
    HeadSlice,
    KVRegion,
    KVTarget,
    MemoryRegion,
    PageRun,
    TransferEngine,
    TransferError,
    coalesce_page_runs,
    kv_write_requests,
    layout_from_description,
)

logger = logging.getLogger(__name__)

__all__ = [
    "HeadSlice", "KVRegion", "KVTarget", "MemoryRegion", "PageRun", "TransferEngine", "TransferError", "coalesce_page_runs",
    "kv_write_requests", "layout_from_description", "make_transfer_engine", "resolve_backend",
]


def resolve_backend(name: str, device: str) -> str:
    """`auto` -> mooncake when it imports and can address `device`'s memory, else tcp."""
    if name != "auto":
        return name
    from pdserve.disagg.transfer.mooncake import import_mooncake

    try:
        mc = import_mooncake()
    except TransferError as exc:
        logger.info("transfer backend auto -> tcp: %s", exc)
        return "tcp"
    if str(device).startswith("cuda") and not getattr(mc, "SUPPORT_CUDA", False):
        logger.info("transfer backend auto -> tcp: the installed mooncake build cannot address CUDA memory")
        return "tcp"
    return "mooncake"


def make_transfer_engine(
    name: str, device: str, ib_device: str | None = None, host: str = "127.0.0.1", timeout_s: float = 30.0,
    advertise_host: str | None = None,
    auth: ClusterAuth | None = None,
) -> TransferEngine:
    """`device` is where the KV cache lives ("cpu", "cuda:0"); `host` is the address to bind, `advertise_host`
    (default `host`) the one peers reach us at, for an engine that names itself by it (mooncake). With `auth`, the
    tcp and nccl engines accept only writes signed with the cluster secret."""
    name = resolve_backend(name, device)
    if name == "mooncake":
        from pdserve.disagg.transfer.mooncake import MooncakeTransferEngine

        return MooncakeTransferEngine(advertise_host or host, str(device), ib_device, bind_host=host)
    if name == "tcp":
        from pdserve.disagg.transfer.tcp import TcpTransferEngine

        return TcpTransferEngine(host, timeout_s=timeout_s, auth=auth)
    if name == "nccl":
        from pdserve.disagg.transfer.nccl import NcclTransferEngine

        return NcclTransferEngine(str(device), host, timeout_s=timeout_s, auth=auth)
    if name == "fake":
        from pdserve.disagg.transfer.fake import FakeTransferEngine

        return FakeTransferEngine()
    raise TransferError(f"unknown transfer backend {name!r}; choose auto, mooncake, nccl, tcp or fake")
