"""`python -m pdserve.bench.accuracy`: a candidate configuration against the baseline on the same prompts."""

from __future__ import annotations

import json

from pdserve.bench.accuracy import RunResult, compare, main


def test_compare_counts_logprob_differences_and_greedy_agreement():
    baseline = RunResult([[-1.0, -2.0], [-0.5]], [[1, 2, 3, 4], [5, 6]])
    candidate = RunResult([[-1.5, -2.0], [-0.25]], [[1, 2, 9, 4], [5, 6]])
    agreement = compare(baseline, candidate)
    assert agreement.scored_positions == 3
    assert agreement.logprob_mean_abs_diff == 0.25 and agreement.logprob_max_abs_diff == 0.5
    assert agreement.greedy_token_agreement == 4 / 6 and agreement.identical_outputs == 0.5
    assert agreement.first_divergence == [0, 2] and compare(baseline, baseline).first_divergence is None


def test_fp8_kv_candidate_against_the_same_model_unquantized(tiny_model, tmp_path):
    common = ["--model-path", tiny_model, "--num-prompts", "4", "--input-len", "48", "--output-len", "6",
              "--device", "cpu", "--skip-server-warmup", "--max-total-tokens", "1024"]
    same = main([*common, "--candidate=--page-size 16"])  # the default page size: the baseline itself
    assert same.logprob_max_abs_diff == 0.0 and same.greedy_token_agreement == 1.0 and same.scored_positions == 4 * 47
    fp8 = main([*common, "--candidate=--kv-cache-dtype fp8_e5m2", "--out", str(tmp_path)])
    assert 0 < fp8.logprob_mean_abs_diff <= fp8.logprob_max_abs_diff
    written = json.loads((tmp_path / "accuracy.json").read_text())
    assert written["candidate"]["kv_cache_dtype"] == "fp8_e5m2" and "kv_cache_dtype" not in written["baseline"]
