"""The constrained-decoding benchmark as users run it (`python -m pdserve.bench.constrained`), end to end against
the real tiny colocated server."""

from __future__ import annotations

import json
import subprocess
import sys

from cluster_util import CHILD_ENV

from pdserve.bench.constrained import MODES, compile_schema, endless_array_schema, parse_counter

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_free_and_constrained_runs_have_equal_lengths_tpots_and_a_first_compile(deployments, tiny_model, tmp_path):
    out, png = tmp_path / "constrained.json", tmp_path / "constrained.png"
    done = subprocess.run([sys.executable, "-m", "pdserve.bench.constrained", "--base-url",
                           deployments["colocated"].url, "--tokenizer", tiny_model, "--batch-sizes", "1", "4",
                           "--input-len", "16", "--output-len", "8", "--repeats", "2", "--compile-repeats", "2",
                           "--disable-progress", "--output", str(out), "--plot", str(png)],
                          capture_output=True, text=True, timeout=240, env=CHILD_ENV)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert [batch["batch_size"] for batch in result["batches"]] == [1, 4]
    for batch in result["batches"]:
        assert batch["output_lens_equal"] and batch["num_prompts"] == batch["batch_size"]
        for mode in MODES:
            summary = batch["modes"][mode]
            assert (summary["completed"], summary["errors"]) == (2 * batch["batch_size"], 0)
            assert summary["output_lens"] == [8] and summary["tpot_ms"]["p50"] > 0
            assert len(summary["run_tpot_p50_ms"]) == 2
        assert batch["tpot_ratio_p50"] > 0
    compile_ = result["first_compile"]
    assert len(compile_["samples"]) == 2
    for sample in compile_["samples"]:
        assert sample["server_counters_delta"]["grammar_compiles"] == 1  # fresh text: one compile, then a hit
        assert sample["server_counters_delta"]["grammar_cache_hits"] == 1
        assert sample["server_compile_ms"] > 0 and sample["ttft_first_ms"] > 0
    assert "first compile of a 20-property schema" in done.stdout
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_the_schemas_are_what_the_benchmark_relies_on():
    assert endless_array_schema(256)["minItems"] == 256
    first, second = compile_schema("a"), compile_schema("b")
    assert len(first["properties"]) == 20 and first["required"] == list(first["properties"])
    assert json.dumps(first) != json.dumps(second)


def test_prometheus_counters_are_summed_over_labels_and_missing_ones_are_none():
    text = ('# HELP pdserve_grammar_compiles x\npdserve_grammar_compiles_total 3.0\n'
            'pdserve_grammar_compile_seconds_total{tp="0"} 0.5\npdserve_grammar_compile_seconds_total{tp="1"} 0.25\n')
    assert parse_counter(text, "pdserve_grammar_compiles") == 3.0
    assert parse_counter(text, "pdserve_grammar_compile_seconds") == 0.75
    assert parse_counter(text, "pdserve_grammar_cache_hits") is None
