"""The base of the transfer engines whose peers talk over pdserve's control transport (tcp, nccl): a server for
the messages peers send this engine, clients to each peer, and one close for both."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.cluster_auth import ClusterAuth
from pdserve.disagg.control_transport import ControlServer, PeerClients
from pdserve.disagg.transfer.base import TransferEngine


class ChannelEngine(TransferEngine):
    def __init__(self, host: str, port: int, timeout_s: float, auth: ClusterAuth | None,
                 handle: Callable):
        super().__init__()
        self._peers = PeerClients(timeout_s, auth)
        self._server = ControlServer(host, port, handle, self.name, auth)
        self._closed = False

    def session_id(self) -> str:
        return self._server.endpoint

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.close()
        self._peers.close()
        self.release()

    def release(self) -> None:
        """What the engine holds beyond its channel (communicators, cached tensors); called once, by `close`."""
