"""`pdserve.bench.one_batch` measures a static batch only when all of it runs at once."""

from __future__ import annotations

import pytest

from pdserve.bench import one_batch


def test_a_batch_the_pool_cannot_hold_at_once_is_refused(tiny_model):
    args = ["--model-path", str(tiny_model), "--input-lens", "64", "--output-lens", "4", "--max-total-tokens", "160",
            "--disable-cuda-graph"]
    rows = one_batch.main([*args, "--batch-sizes", "2"])  # 2 x 68 tokens (80 in pages of 16) fit 160 slots
    assert [(r["batch_size"], r["input_len"], r["output_len"]) for r in rows] == [(2, 64, 4)]
    with pytest.raises(RuntimeError, match="requests ran at once after the prefill, not 4"):
        one_batch.main([*args, "--batch-sizes", "4"])
