"""The prefill's KV write rate as a share of the link (`--disaggregation-link-gbps`) on /metrics."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pdserve.disagg.transfer_stats import TransferStats
from pdserve.server.metrics import ServerMetrics


def rendered(stats: TransferStats) -> dict:
    text = ServerMetrics("m").render({"kv_transfer": stats.snapshot({"bootstrap": 0, "transfer": 0})}, in_flight=0)
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_the_link_efficiency_is_bytes_over_write_time_over_the_link():
    stats = TransferStats("prefill", link_gbps=400.0)
    stats.moved(300 << 20, 0.002)  # 157 GB/s
    stats.moved(100 << 20, 0.0005)
    values = rendered(stats)
    assert values["pdserve_kv_transfer_write_seconds_total"] == 0.0025
    assert values["pdserve_kv_transfer_link_efficiency"] == (400 << 20) / 0.0025 / 400e9


def test_no_efficiency_without_a_link_bandwidth_or_a_write():
    unknown_link = TransferStats("prefill")
    unknown_link.moved(1 << 20, 0.001)
    idle = TransferStats("prefill", link_gbps=400.0)
    for stats in (unknown_link, idle, TransferStats("decode", link_gbps=400.0)):
        values = rendered(stats)
        assert "pdserve_kv_transfer_link_efficiency" not in values
        assert "pdserve_kv_transfer_write_seconds_total" in values
