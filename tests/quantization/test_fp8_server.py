"""A server on an FP8 checkpoint (no --quantization needed) with --quantize-lm-head reports its quantization in
/get_server_info and /get_model_info and serves what the offline engine generates with the same settings."""

from __future__ import annotations

import cluster_util

from pdserve import LLM, SamplingParams

PROMPT = [11, 200, 37, 901, 5, 64, 300]


def test_server_reports_and_serves_fp8(fp8_models, tmp_path):
    path = fp8_models["qwen3-tiny", "ct-channel"]
    server = cluster_util.server("fp8", path, "--quantize-lm-head", log_path=str(tmp_path / "server.log"))
    cluster_util.start_all([server])
    try:
        info = server.get("/get_server_info").json()
        assert (info["quantization"], info["quantize_lm_head"]) == (None, True)
        assert server.get("/get_model_info").json()["quantization"] == info["model_info"]["quantization"] == {
            "method": "compressed-tensors", "lm_head": True,
            "weights": "float8_e4m3fn per output channel (from the compressed-tensors checkpoint)",
            "activations": "float8_e4m3fn per token (dynamic)"}
        body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
        served = server.post("/generate", body).json()["output_ids"]
    finally:
        server.stop()
    llm = LLM(path, device="cpu", quantize_lm_head=True, max_total_tokens=1024)
    try:
        offline = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert served == offline[0].token_ids
    finally:
        llm.shutdown()
