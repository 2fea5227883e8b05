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


@pytest.mark.parametrize("output_len", [4, 16, 64, 200])
def test_the_gpu_busy_profile_leaves_as_many_steps_to_time(output_len):
    decode_steps = output_len - 1  # the prefill gives the first token
    profiled = one_batch.profiled_steps(output_len)
    assert 0 <= profiled <= 16 and decode_steps - profiled - 1 >= profiled  # the last step is not between tokens


def test_time_between_tokens_leaves_out_the_step_that_ends_the_batch(tiny_model):
    rows = one_batch.main(["--model-path", str(tiny_model), "--input-lens", "32", "--output-lens", "16",
                           "--batch-sizes", "2", "--disable-cuda-graph"])
    assert rows[0]["tbt_steps"] >= 14 and rows[0]["tbt_s"] > 0
