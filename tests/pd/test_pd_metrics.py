"""The PD roles' KV-transfer metrics on /metrics, as Prometheus reads them: a request through the router moves
the same bytes out of the prefill as into the decode and counts one transfer on each, and nothing is left queued.
Failures by reason: tests/pd/test_pd_failures.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cluster_util import PDCluster, Proc, wait_kv_free
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(900)  # the first test also pays for starting the servers

TRANSFER_FAMILIES = {"pdserve_kv_transfer_bytes", "pdserve_kv_transfers", "pdserve_kv_transfer_duration_seconds",
                     "pdserve_kv_transfer_failures", "pdserve_pd_queue_requests"}


def samples(proc: Proc) -> dict[tuple, float]:
    """(series name, sorted label items) -> value, for every sample of the server's /metrics page."""
    reply = proc.get("/metrics")
    assert reply.status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(reply.body.decode()) for s in family.samples}


def value(page: dict, name: str, **labels) -> float:
    return page.get((name, tuple(sorted(labels.items()))), 0.0)


def test_colocated_server_has_no_transfer_metrics(colocated: Proc):
    names = {name for name, _ in samples(colocated)}
    assert not any(name.startswith(tuple(TRANSFER_FAMILIES)) for name in names)


def test_a_request_counts_one_transfer_and_the_same_bytes_on_both_roles(pd: PDCluster):
    before = {role: samples(proc) for role, proc in (("prefill", pd.prefill), ("decode", pd.decode))}
    prompt_ids = list(range(3, 3 + 40))  # 3 pages of 16
    reply = pd.router.post("/generate", {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 4}})
    assert reply.status == 200, reply.body
    wait_kv_free(pd.servers)
    after = {role: samples(proc) for role, proc in (("prefill", pd.prefill), ("decode", pd.decode))}
    moved = {}
    for role in ("prefill", "decode"):
        def delta(name, **labels):
            return value(after[role], name, role=role, **labels) - value(before[role], name, role=role, **labels)

        assert delta("pdserve_kv_transfers_total") == 1, role
        assert delta("pdserve_kv_transfer_duration_seconds_count") == 1, role
        assert delta("pdserve_kv_transfer_duration_seconds_bucket", le="+Inf") == 1, role
        assert delta("pdserve_kv_transfer_duration_seconds_sum") > 0, role
        for queue in ("bootstrap", "transfer"):
            assert value(after[role], "pdserve_pd_queue_requests", role=role, queue=queue) == 0, (role, queue)
        moved[role] = delta("pdserve_kv_transfer_bytes_total")
    assert moved["prefill"] == moved["decode"] == kv_bytes(pd.decode, pages=3)


def kv_bytes(proc: Proc, pages: int) -> int:
    """Bytes of `pages` KV pages, K and V of every layer, from the served model's config.json."""
    info = proc.get("/get_model_info").json()
    cfg = json.loads((Path(info["model_path"]) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[info["dtype"]]
    token_bytes = cfg["num_key_value_heads"] * head_dim * itemsize
    return pages * info["page_size"] * token_bytes * 2 * cfg["num_hidden_layers"]

