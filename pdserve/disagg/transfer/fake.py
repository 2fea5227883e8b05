"""A transfer engine that moves no data: for warm-up requests and decode-only benchmarking."""

from __future__ import annotations

from pdserve.disagg.transfer.base import TransferEngine, check_batch


class FakeTransferEngine(TransferEngine):
    name = "fake"

    def session_id(self) -> str:
        return "fake:0"

    def write(self, peer_session: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]) -> None:
        check_batch(src_ptrs, dst_ptrs, lengths)
        for ptr, n in zip(src_ptrs, lengths):
            self.regions.find(ptr, n)

    def transport(self) -> str:
        return "fake"

    def close(self) -> None:
        pass
