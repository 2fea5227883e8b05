"""NCCL point-to-point transfer: a 2-rank communicator per (prefill sender, decode receiver) pair.

NCCL is two-sided, so each `write` is a small protocol over the engine's ZMQ control channel:
  sender -> {"op": "write", "from": <sender session>, "dst": [[ptr, len], ...]}
  receiver checks every span against its registered CUDA regions, replies {"ok", "phase": "ready"},
  posts one ncclRecv per span on its receive stream; the sender posts the matching ncclSend's (same
  order, same lengths) on its send stream; both wait for their stream (with a timeout; a stuck
  communicator is aborted); the receiver replies "done" and `write` returns.
The communicator is made at the first contact ("init"): the sender draws an ncclUniqueId (128 bytes),
ships it with its GPU's UUID, and both call ncclCommInitRank(2, uid, rank) with rank 0 = sender, rank 1 =
receiver. The receiver first refuses a sender on its own physical GPU (NCCL refuses two ranks of a communicator on
one device, so the pair could never link), then joins on a helper thread, so a sender that dies mid-handshake
cannot wedge the control thread. No torch.distributed world is involved.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import logging
import os
import threading
import time
from pathlib import Path
from typing import Mapping

import torch

from pdserve.disagg.transfer.base import TransferError
from pdserve.disagg.transfer.channel_engine import ChannelEngine
from pdserve.cluster_auth import ClusterAuth
from pdserve.disagg.control_transport import parse_spans

logger = logging.getLogger(__name__)

NCCL_UNIQUE_ID_BYTES = 128
NCCL_UINT8 = 1  # ncclUint8
MAX_OPS_PER_GROUP = 1024  # sends (or recvs) fused per ncclGroupStart/End


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


def unique_id_from_bytes(raw: bytes) -> NcclUniqueId:
    if not isinstance(raw, bytes) or len(raw) != NCCL_UNIQUE_ID_BYTES:
        raise TransferError(f"an ncclUniqueId is {NCCL_UNIQUE_ID_BYTES} bytes, got {type(raw).__name__} "
                            f"of length {len(raw) if isinstance(raw, bytes) else '?'}")
    uid = NcclUniqueId()
    ctypes.memmove(ctypes.addressof(uid), raw, NCCL_UNIQUE_ID_BYTES)
    return uid


def nccl_library_candidates(environ: Mapping[str, str] = os.environ, search_roots: list[str] | None = None) -> list[str]:
    """Where libnccl may live, best first: $PDSERVE_NCCL_LIBRARY, the nvidia-nccl-cu12/-cu13 wheels,
    torch's lib dir, then the bare soname for the system loader."""
    out = []
    if environ.get("PDSERVE_NCCL_LIBRARY"):
        out.append(environ["PDSERVE_NCCL_LIBRARY"])
    if search_roots is None:
        search_roots = _nvidia_roots() + [str(Path(torch.__file__).parent)]
    for root in search_roots:
        for pattern in ("nccl/lib/libnccl.so*", "cu*/lib/libnccl.so*", "lib/libnccl.so*"):
            out.extend(sorted(glob.glob(os.path.join(root, pattern)), key=len))
    out.append("libnccl.so.2")
    return list(dict.fromkeys(out))


def _nvidia_roots() -> list[str]:
    spec = importlib.util.find_spec("nvidia")
    return list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []


def load_nccl(candidates: list[str] | None = None) -> "NcclLibrary":
    errors = []
    for path in candidates or nccl_library_candidates():
        try:
            return NcclLibrary(ctypes.CDLL(path), path)
        except (OSError, AttributeError) as exc:
            errors.append(f"{path}: {exc}")
    raise TransferError("libnccl not found; install nvidia-nccl-cu12 or -cu13 or set PDSERVE_NCCL_LIBRARY. Tried: "
                        + "; ".join(errors))


class NcclLibrary:
    """The handful of NCCL entry points we need, with every return code checked."""

    _SIGNATURES = {
        "ncclGetVersion": [ctypes.POINTER(ctypes.c_int)],
        "ncclGetUniqueId": [ctypes.POINTER(NcclUniqueId)],
        "ncclCommInitRank": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, NcclUniqueId, ctypes.c_int],
        "ncclSend": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p],
        "ncclRecv": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p],
        "ncclGroupStart": [],
        "ncclGroupEnd": [],
        "ncclCommAbort": [ctypes.c_void_p],
    }

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.path = path
        for name, argtypes in self._SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            setattr(self, "_" + name, fn)
        self._error_string = lib.ncclGetErrorString
        self._error_string.argtypes, self._error_string.restype = [ctypes.c_int], ctypes.c_char_p
        version = ctypes.c_int()
        self._check(self._ncclGetVersion(ctypes.byref(version)), "ncclGetVersion")
        self.version = version.value

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise TransferError(f"{what} failed: {self._error_string(rc).decode()} (ncclResult {rc})")

    def unique_id(self) -> bytes:
        uid = NcclUniqueId()
        self._check(self._ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return ctypes.string_at(ctypes.addressof(uid), NCCL_UNIQUE_ID_BYTES)

    def comm_init_rank(self, nranks: int, uid: bytes, rank: int) -> int:
        comm = ctypes.c_void_p()
        self._check(self._ncclCommInitRank(ctypes.byref(comm), nranks, unique_id_from_bytes(uid), rank),
                    "ncclCommInitRank")
        return comm.value

    def send_all(self, spans: list[tuple[int, int]], peer: int, comm: int, stream: int) -> None:
        self._grouped(self._ncclSend, "ncclSend", spans, peer, comm, stream)

    def recv_all(self, spans: list[tuple[int, int]], peer: int, comm: int, stream: int) -> None:
        self._grouped(self._ncclRecv, "ncclRecv", spans, peer, comm, stream)

    def _grouped(self, fn, what: str, spans, peer: int, comm: int, stream: int) -> None:
        for group in plan_groups(spans):
            self._check(self._ncclGroupStart(), "ncclGroupStart")
            try:
                for ptr, n in group:
                    self._check(fn(ptr, n, NCCL_UINT8, peer, comm, stream), what)
            finally:
                self._check(self._ncclGroupEnd(), "ncclGroupEnd")

    def abort(self, comm: int) -> None:
        self._check(self._ncclCommAbort(comm), "ncclCommAbort")


def gpu_uuid(device: torch.device) -> str:
    """The physical GPU behind `device`, the same in every process whatever its CUDA_VISIBLE_DEVICES."""
    return str(torch.cuda.get_device_properties(device).uuid)


def check_distinct_gpus(receiver_gpu: str, sender_gpu: object, receiver_device: torch.device) -> None:
    """Refuse a sender on the receiver's own physical GPU (compared by UUID): NCCL fails to init such a pair
    ("Duplicate GPU detected", ncclInvalidUsage), e.g. a prefill and a decode at TP 2 sharing two GPUs."""
    if not isinstance(sender_gpu, str) or not sender_gpu:
        raise TransferError("nccl init without the sender's GPU UUID")
    if sender_gpu == receiver_gpu:
        raise TransferError(
            f"the nccl transfer backend cannot link a prefill and a decode on the same GPU ({receiver_device} here, "
            f"UUID {receiver_gpu}): NCCL refuses two ranks of one communicator on one device. Use "
            "--disaggregation-transfer-backend mooncake, or put the prefill and the decode on different GPUs "
            "(--base-gpu-id)")


def plan_groups(spans: list[tuple[int, int]], max_ops: int = MAX_OPS_PER_GROUP) -> list[list[tuple[int, int]]]:
    return [spans[i : i + max_ops] for i in range(0, len(spans), max_ops)]


class _PendingComm:
    """A receiver-side communicator being joined on a helper thread."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.comm: int | None = None
        self.error: str | None = None


class NcclTransferEngine(ChannelEngine):
    name = "nccl"

    def __init__(self, device: str, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0,
                 library: NcclLibrary | None = None, auth: ClusterAuth | None = None):
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise TransferError(f"the nccl transfer backend needs the KV cache on CUDA, not {device}")
        self.device = torch.device("cuda", self.device.index if self.device.index is not None
                                   else torch.cuda.current_device())
        self.timeout_s = timeout_s
        self.gpu = gpu_uuid(self.device)
        self._nccl = library or load_nccl()
        self._send_stream = torch.cuda.Stream(self.device)
        self._recv_stream = torch.cuda.Stream(self.device)
        self._send_comms: dict[str, int] = {}  # peer session -> comm (we are rank 0)
        self._recv_comms: dict[str, _PendingComm] = {}  # sender session -> comm (we are rank 1)
        super().__init__(host, port, timeout_s, auth, self._handle)  # last: its server calls _handle at once
        logger.info("nccl transfer engine %s on %s (GPU %s; %s, version %d)", self.session_id(), self.device,
                    self.gpu, self._nccl.path, self._nccl.version)

    def transport(self) -> str:
        return "nccl"

    def register(self, ptr: int, length: int, device: str = "cpu") -> None:
        if torch.device(device) != self.device:
            raise TransferError(f"the nccl engine on {self.device} cannot register memory on {device}")
        super().register(ptr, length, device)

    # --- sender side (rank 0) ---

    def connect(self, peer_session: str) -> None:
        if peer_session in self._send_comms:
            return
        client = self._peers.get(peer_session)
        uid = self._nccl.unique_id()
        try:
            client.send({"op": "init", "from": self.session_id(), "uid": uid, "gpu": self.gpu})
            client.recv("nccl init reply")
            with torch.cuda.device(self.device):
                self._send_comms[peer_session] = self._nccl.comm_init_rank(2, uid, 0)
        except TransferError as exc:
            logger.error("no nccl link from %s to %s: %s", self.device, peer_session, exc)
            self._peers.drop(peer_session)
            raise

    def write(self, peer_session: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]) -> None:
        if not self.has_spans_to_write(src_ptrs, dst_ptrs, lengths):
            return
        self.connect(peer_session)
        comm = self._send_comms[peer_session]
        client = self._peers.get(peer_session)
        try:
            client.send({"op": "write", "from": self.session_id(), "dst": [[d, n] for d, n in zip(dst_ptrs, lengths)]})
            client.recv("nccl write ready")
            with torch.cuda.device(self.device):
                self._nccl.send_all(list(zip(src_ptrs, lengths)), 1, comm, self._send_stream.cuda_stream)
            if not _wait_stream(self._send_stream, self.timeout_s):
                self._drop_send_comm(peer_session)
                raise TransferError(f"nccl send to {peer_session} did not finish within {self.timeout_s:.0f}s")
            client.recv("nccl write done")
        except TransferError:
            self._peers.drop(peer_session)
            raise

    def _drop_send_comm(self, peer_session: str) -> None:
        comm = self._send_comms.pop(peer_session, None)
        if comm is not None:
            self._nccl.abort(comm)

    # --- receiver side (rank 1), on the control thread ---

    def _handle(self, header: dict, frames: list, reply) -> None:
        sender = header.get("from")
        if not isinstance(sender, str):
            raise TransferError("message without a sender session")
        op = header.get("op")
        if op == "init":
            check_distinct_gpus(self.gpu, header.get("gpu"), self.device)
            self._join(sender, header.get("uid"))
            reply({"ok": True, "phase": "ready"})
        elif op == "write":
            self._receive(sender, parse_spans(header), reply)
        else:
            raise TransferError(f"unknown op {op!r}")

    def _join(self, sender: str, uid: bytes) -> None:
        unique_id_from_bytes(uid)  # validate before spawning anything
        old = self._recv_comms.pop(sender, None)
        if old is not None and old.comm is not None:
            self._nccl.abort(old.comm)  # the sender restarted; its old communicator is dead
        pending = self._recv_comms[sender] = _PendingComm()

        def join() -> None:
            try:
                with torch.cuda.device(self.device):
                    pending.comm = self._nccl.comm_init_rank(2, uid, 1)
            except TransferError as exc:
                pending.error = str(exc)
            finally:
                pending.ready.set()

        threading.Thread(target=join, name=f"nccl-join-{sender}", daemon=True).start()

    def _receive(self, sender: str, spans: list[tuple[int, int]], reply) -> None:
        for ptr, n in spans:
            self.regions.find(ptr, n)
        pending = self._recv_comms.get(sender)
        if pending is None:
            raise TransferError(f"no nccl communicator with {sender}; it must send init first")
        if not pending.ready.wait(self.timeout_s) or pending.comm is None:
            self._recv_comms.pop(sender, None)
            raise TransferError(f"nccl communicator with {sender} not ready: {pending.error or 'timeout'}")
        reply({"ok": True, "phase": "ready"})
        with torch.cuda.device(self.device):
            self._nccl.recv_all(spans, 0, pending.comm, self._recv_stream.cuda_stream)
        if not _wait_stream(self._recv_stream, self.timeout_s):
            self._recv_comms.pop(sender, None)
            self._nccl.abort(pending.comm)
            raise TransferError(f"nccl receive from {sender} did not finish within {self.timeout_s:.0f}s")
        reply({"ok": True, "phase": "done"})

    def release(self) -> None:
        # abort, not destroy: local and never blocks on a peer that is already gone
        for comm in self._send_comms.values():
            self._nccl.abort(comm)
        for pending in self._recv_comms.values():
            if pending.comm is not None:
                self._nccl.abort(pending.comm)
        self._send_comms.clear()
        self._recv_comms.clear()


def _wait_stream(stream: torch.cuda.Stream, timeout_s: float) -> bool:
    event = torch.cuda.Event()
    event.record(stream)
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(20e-6)
    return True
