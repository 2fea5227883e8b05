"""`GET /load` from a live decode server with a TPOT budget: every key the router reads, of the right type and
range, the step costs known from the warm-up before the first request, a local prefill measured and counted."""

from __future__ import annotations

import pytest
from cluster_util import decode_server, scheduler_stats, start_all, stop_all, wait_kv_free

pytestmark = pytest.mark.timeout(900)  # the server starts inside the test

BUDGET_MS = 10.0
KEY_TYPES = {"queued_prefill_tokens": int, "prefill_tokens_per_s": float, "local_prefill_tokens_per_s": float,
             "local_prefill_burst_s": float, "extend_fixed_ms": float, "extend_us_per_token": float,
             "decode_step_ms": float, "num_running_reqs": int, "kv_usage": float, "tpot_budget_ms": float}


def check_types(load: dict) -> None:
    for key, kind in KEY_TYPES.items():
        assert type(load[key]) is kind, (key, load[key])
    assert 0.0 <= load["kv_usage"] <= 1.0 and load["tpot_budget_ms"] == BUDGET_MS


def test_a_decode_server_with_a_budget_reports_its_load(tiny_model):
    decode = decode_server(tiny_model, "tcp", "--decode-tpot-budget-ms", str(BUDGET_MS), name="decode-budget")
    start_all([decode])
    try:
        warmed = decode.get("/load").json()
        check_types(warmed)
        assert warmed["queued_prefill_tokens"] == 0 and warmed["num_running_reqs"] == 0
        assert warmed["prefill_tokens_per_s"] == 0.0  # no request measured yet, as before the warm-up
        assert warmed["local_prefill_tokens_per_s"] > 0 and warmed["decode_step_ms"] > 0  # the warm-up's costs
        assert warmed["extend_us_per_token"] > 0 and warmed["local_prefill_burst_s"] == 0.0  # nothing decoding
        ids = [(i * 31 + 7) % 1000 + 3 for i in range(300)]
        reply = decode.post("/generate", {"input_ids": ids,  # no bootstrap fields: prefilled here
                                          "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}})
        assert reply.status == 200 and len(reply.json()["output_ids"]) == 8
        wait_kv_free([decode])
        after = decode.get("/load").json()
        check_types(after)
        assert after["prefill_tokens_per_s"] > 0 and after["kv_usage"] == 0.0
        stats = scheduler_stats(decode)
        assert stats["num_local_prefills"] == 1 and stats["tpot_budget"]["decode_steps"] >= 7
    finally:
        stop_all([decode])
