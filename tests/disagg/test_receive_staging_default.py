"""Receive staging on by default: its automatic size, the backends it stays off on, the fall back to direct writes
when it cannot be had, and what the decode reports of it (stats and /metrics)."""

from __future__ import annotations

import logging

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from test_pd_schedulers import check_pd_equals_colocated
from test_receive_staging import small_pool, staging_pair

from pdserve.config import ConfigError, ServerArgs
from pdserve.disagg.transfer import TransferError, make_transfer_engine
from pdserve.disagg.transfer.receive_staging import (AUTO_MAX_BYTES, AUTO_MIN_BYTES, ReceiveStaging,
                                                     open_receive_staging, receive_staging_bytes)
from pdserve.server.metrics import ServerMetrics


class RefusingEngine:
    """A transfer engine whose registrations fail (as mooncake's may, or the nccl engine's off its device)."""

    name = "tcp"

    def register(self, ptr: int, length: int, device: str = "cpu") -> None:
        raise TransferError("register refused")


def test_the_automatic_size_is_an_eighth_of_the_pool_within_its_bounds():
    assert receive_staging_bytes(None, 80 << 20) == 10 << 20
    assert receive_staging_bytes(None, 1 << 20) == AUTO_MIN_BYTES
    assert receive_staging_bytes(None, 100 << 30) == AUTO_MAX_BYTES
    assert receive_staging_bytes(3, 100 << 30) == 3 << 20
    assert receive_staging_bytes(0, 100 << 30) == 0


def test_staging_is_on_by_default_and_zero_turns_it_off():
    assert ServerArgs(model_path="m").disaggregation_staging_mb is None
    assert ServerArgs.from_cli(["--model-path", "m", "--disaggregation-staging-mb", "0"]).disaggregation_staging_mb == 0
    with pytest.raises(ConfigError, match="staging-mb must be >= 0"):
        ServerArgs(model_path="m", disaggregation_staging_mb=-1)


def test_the_prefill_waits_50_ms_for_a_staging_answer_by_default():
    assert ServerArgs(model_path="m").disaggregation_staging_wait_ms == 50.0
    args = ServerArgs.from_cli(["--model-path", "m", "--disaggregation-staging-wait-ms", "0"])
    assert args.disaggregation_staging_wait_ms == 0
    with pytest.raises(ConfigError, match="staging-wait-ms must be >= 0"):
        ServerArgs(model_path="m", disaggregation_staging_wait_ms=-1)


def test_no_staging_for_zero_or_an_engine_that_moves_no_bytes():
    pool = small_pool()
    for backend, staging_mb in (("fake", None), ("tcp", 0)):
        engine = make_transfer_engine(backend, "cpu", timeout_s=5)
        try:
            assert open_receive_staging(engine, pool, staging_mb) is None
            assert len(engine.regions) == 0
        finally:
            engine.close()


def test_the_automatic_size_gives_way_to_direct_writes_when_it_cannot_be_registered(caplog):
    with caplog.at_level(logging.WARNING, logger="pdserve.disagg.transfer.receive_staging"):
        assert open_receive_staging(RefusingEngine(), small_pool(), None) is None
    assert "handoffs write their pages directly" in caplog.text
    with pytest.raises(TransferError, match="register refused"):
        open_receive_staging(RefusingEngine(), small_pool(), 1)  # a size the user asked for fails loudly


def test_the_automatic_size_gives_way_when_it_cannot_be_allocated(monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("no room for staging")

    engine = make_transfer_engine("tcp", "cpu", timeout_s=5)
    monkeypatch.setattr(ReceiveStaging, "__init__", lambda self, *args: out_of_memory())
    try:
        assert open_receive_staging(engine, small_pool(), None) is None
        with pytest.raises(torch.OutOfMemoryError):
            open_receive_staging(engine, small_pool(), 1)
    finally:
        engine.close()


def test_a_default_decode_stages_its_handoffs_and_reports_them(tiny_model):
    """No staging flag: the decode makes its automatic staging, every handoff from the same-TP prefill is staged, and
    its stats and /metrics say so; every slot is back afterwards."""
    prefill, decode, port = staging_pair(tiny_model)
    try:
        receive = decode.role.receive
        assert receive is not None and receive.buffer.numel() == receive_staging_bytes(None, decode.runner.pool.nbytes)
        check_pd_equals_colocated(tiny_model, (prefill, decode, port), (3, 31, 70), seed=11, first_room=1100)
        receive.collect()
        stats = decode.stats()["receive_staging"]
        assert stats == {"bytes": receive.buffer.numel(), "slots": 0, "staged": 3, "scattered": 0, "missed": 0,
                         "late": 0}
        assert receive.arena.bytes_in_use == 0
        assert "receive_staging" not in prefill.stats()
    finally:
        prefill.close()
        decode.close()


def test_the_staging_metrics():
    text = ServerMetrics("m").render({"receive_staging": {"bytes": 1 << 20, "slots": 2, "staged": 7, "scattered": 3,
                                                           "missed": 4, "late": 1}}, in_flight=0)
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["pdserve_kv_receive_staged_total"] == 7
    assert values["pdserve_kv_receive_staged_scattered_total"] == 3
    assert values["pdserve_kv_receive_staging_missed_total"] == 4
    assert values["pdserve_kv_receive_staging_late_total"] == 1
    assert values["pdserve_kv_receive_staging_slots"] == 2
    assert values["pdserve_kv_receive_staging_bytes"] == 1 << 20
    without = ServerMetrics("m").render({"receive_staging": None}, in_flight=0)
    assert "kv_receive_stag" not in without
