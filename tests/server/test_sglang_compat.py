"""SGLang's launch flags and request fields: every flag name of SGLang's ServerArgs is implemented, accepted or
refused in one line (never "unrecognized"); every GenerateReqInput and SamplingParams field at its default is
accepted; the cheap flags (--log-requests, --stream-interval, --chat-template, --tokenizer-mode) work."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdserve.config import ConfigError, ServerArgs, build_arg_parser, parse_server_cli
from pdserve.messages import StrOut
from pdserve.sampling_params import SamplingParams
from pdserve.server.generation import output_stream, stream_interval_of
from pdserve.server.http_common import ApiError
from pdserve.server.schemas import GenerateReqInput, sglang_sampling_params
from pdserve.server.tokenizer_manager import GenerateRequest, OutputDelta
from pdserve.tokenizer import chat_template_text, load_tokenizer

SGLANG_FLAGS = [line for line in (Path(__file__).parent / "sglang_server_flags.txt").read_text().splitlines()
                if line.startswith("--")]

# SGLang 0.5.23's GenerateReqInput and SamplingParams fields at their defaults (io_struct.py, sampling_params.py)
SGLANG_GENERATE_DEFAULTS = {
    "rid": None, "session_id": None, "input_ids": None, "input_embeds": None, "image_data": None, "video_data": None,
    "audio_data": None, "mm_hashes": None, "mm_content_hashes": None, "use_audio_in_video": False,
    "video_config": None, "watermark": None, "return_logprob": None, "logprob_start_len": None,
    "top_logprobs_num": None, "token_ids_logprob": None, "return_sampling_mask": None,
    "sampling_logprobs_mode": None, "return_text_in_logprobs": False, "return_flat_raw_top_logprobs": False,
    "return_flat_raw_output_top_logprobs": False, "return_flat_raw_top_logprobs_b64": False, "stream": False,
    "log_metrics": True, "return_hidden_states": False, "return_routed_experts": False,
    "routed_experts_start_len": 0, "return_indexer_topk": False, "modalities": None, "session_params": None,
    "lora_path": None, "lora_id": None, "custom_logit_processor": None, "positional_embed_overrides": None,
    "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None, "bootstrap_pair_key": None,
    "decode_tp_size": None, "routed_dp_rank": None, "data_parallel_rank": None, "disagg_prefill_dp_rank": None,
    "routing_key": None, "conversation_id": None, "http_worker_ipc": None, "background": False,
    "require_reasoning": False, "max_thinking_tokens": None, "priority": None, "extra_key": None, "no_logs": False,
    "custom_labels": None, "return_bytes": False, "return_entropy": False, "return_prompt_token_ids": False,
    "external_trace_header": None, "received_time": None, "need_wait_for_mm_inputs": None,
    "num_items_assigned": None, "encoder_urls": None, "max_dynamic_patch": None, "min_dynamic_patch": None,
    "image_max_dynamic_patch": None, "video_max_dynamic_patch": None, "images_config": None,
    "mm_processor_kwargs": None, "multi_item_delimiter_indices": None, "token_indices_to_pool": None,
    "cache_salt": None, "kv_hints": None,
}
SGLANG_SAMPLING_DEFAULTS = {
    "max_new_tokens": 128, "stop": None, "stop_token_ids": None, "stop_regex": None, "temperature": 1.0,
    "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "beam_width": None, "json_schema": None,
    "regex": None, "ebnf": None, "structural_tag": None, "ignore_eos": False, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "no_stop_trim": False, "stream_interval": None, "logit_bias": None,
    "sampling_seed": None, "custom_params": None, "watermark": None, "ebnf_full_assistant": False,
}


def _parse(*flags: str) -> ServerArgs:
    return parse_server_cli(build_arg_parser(), ["--model-path", "m", *flags])[1]


@pytest.mark.parametrize("flag", SGLANG_FLAGS)
def test_no_sglang_flag_is_unrecognized(flag):
    try:
        _parse(flag)
    except ConfigError as exc:
        assert "unrecognized" not in str(exc) and "\n" not in str(exc)


def test_flags_pdserve_already_obeys_are_accepted_with_a_note():
    args = _parse("--enable-metrics", "--dp-size", "1", "--pp-size=1")
    assert args.sglang_flag_notes == (
        "--enable-metrics: accepted, metrics are always on at /metrics",
        "--dp-size 1: accepted, pdserve behaves so", "--pp-size 1: accepted, pdserve behaves so")


def test_tool_call_parser_is_a_real_flag():
    assert _parse("--tool-call-parser", "llama3").tool_call_parser == "llama3"
    with pytest.raises(ConfigError, match="--tool-call-parser must be qwen25 or llama3"):
        _parse("--tool-call-parser", "mistral")


def test_grammar_backend_is_a_real_flag():
    assert _parse("--grammar-backend", "none").grammar_backend == "none"
    assert _parse().grammar_backend == "xgrammar"
    with pytest.raises(ConfigError, match="--grammar-backend must be xgrammar or none"):
        _parse("--grammar-backend", "outlines")


@pytest.mark.parametrize("flags, message", [
    (["--dp-size", "2"], "--dp-size 2 needs data parallelism"),
    (["--quantization", "awq"], "--quantization awq needs awq quantized weights, which pdserve does not implement"),
    (["--enable-lora"], "--enable-lora needs LoRA adapters"),
    (["--speculative-algorithm", "EAGLE"], "--speculative-algorithm EAGLE needs speculative decoding"),
    (["--no-such-flag"], "unrecognized argument --no-such-flag"),
])
def test_missing_features_are_named(flags, message):
    with pytest.raises(ConfigError, match=message):
        _parse(*flags)


def test_a_refused_flag_is_one_line_and_exit_code_2():
    result = subprocess.run([sys.executable, "-m", "pdserve.launch_server", "--model-path", "m", "--enable-lora"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == ("python -m pdserve.launch_server: error: --enable-lora needs LoRA adapters, "
                             "which pdserve does not implement\n")


def test_every_sglang_request_field_at_its_default_is_accepted():
    body = GenerateReqInput.model_validate(
        {**SGLANG_GENERATE_DEFAULTS, "text": "a", "sampling_params": SGLANG_SAMPLING_DEFAULTS})
    assert body.unsupported_feature() is None
    assert sglang_sampling_params(body, body.sampling_params).max_tokens == 128


@pytest.mark.parametrize("field, value", [
    ("watermark", {"key": 1}), ("sampling_logprobs_mode", "selected"), ("return_flat_raw_output_top_logprobs", True),
    ("kv_hints", {"block_hashes": ["a"]}), ("token_indices_to_pool", [1]),
])
def test_newer_sglang_fields_asking_for_a_missing_feature_are_named(field, value):
    assert GenerateReqInput.model_validate({"text": "a", field: value}).unsupported_feature() == f"{field}={value!r}"


def test_sampling_fields_beam_width_and_watermark_are_named():
    body = GenerateReqInput.model_validate({"text": "a", "sampling_params": {"beam_width": 4}})
    assert body.unsupported_feature() == "beam_width=4"


# --- the implemented flags ---------------------------------------------------------------------------------------


def _fake_manager(args: ServerArgs, outs: list[StrOut]) -> SimpleNamespace:
    async def generate(request, exchange):
        for out in outs:
            yield OutputDelta(out, None, 0.1, 0.2)

    tokenizer = SimpleNamespace(decode=lambda ids: "prompt " * len(ids))
    return SimpleNamespace(args=args, generate=generate, tokenizer=tokenizer)


def _outs(tokens: int) -> list[StrOut]:
    finish = {"type": "length"}
    return [StrOut("r", f"t{i} ", [i], finish if i == tokens - 1 else None, 2, i + 1, 0) for i in range(tokens)]


async def _deltas(tm, streamed: bool, stream_interval: int | None = None) -> list[OutputDelta]:
    request = GenerateRequest("r", [5, 6], SamplingParams(), stream_interval=stream_interval)
    return [delta async for delta in output_stream(tm, request, streamed, None)]


def test_stream_interval_groups_tokens_and_flushes_at_the_end():
    tm = _fake_manager(ServerArgs(model_path="m", stream_interval=3), _outs(7))
    deltas = asyncio.run(_deltas(tm, streamed=True))
    assert [d.out.new_token_ids for d in deltas] == [[0, 1, 2], [3, 4, 5], [6]]
    assert deltas[0].out.text == "t0 t1 t2 " and deltas[-1].finished
    assert len(asyncio.run(_deltas(tm, streamed=False))) == 7  # a whole response is not grouped


def test_a_request_s_stream_interval_overrides_the_server_s():
    tm = _fake_manager(ServerArgs(model_path="m", stream_interval=3), _outs(5))
    deltas = asyncio.run(_deltas(tm, streamed=True, stream_interval=2))
    assert [d.out.new_token_ids for d in deltas] == [[0, 1], [2, 3], [4]]


def test_stream_interval_is_read_from_sampling_params_or_beside_them():
    body = GenerateReqInput.model_validate({"text": "a", "stream_interval": 4, "sampling_params": {"stream_interval": 2}})
    assert stream_interval_of(body, body.sampling_params) == 2
    assert stream_interval_of(body, None) == 4
    with pytest.raises(ApiError, match="at least 1"):
        stream_interval_of(GenerateReqInput.model_validate({"text": "a", "stream_interval": 0}), None)


def test_log_requests_logs_id_counts_and_text_by_level(caplog):
    caplog.set_level(logging.INFO, "pdserve.requests")
    asyncio.run(_deltas(_fake_manager(ServerArgs(model_path="m", log_requests=True, log_requests_level=0), _outs(2)),
                        streamed=False))
    asyncio.run(_deltas(_fake_manager(ServerArgs(model_path="m", log_requests=True), _outs(2)), streamed=False))
    assert [r.getMessage() for r in caplog.records] == [
        "request r: 2 prompt tokens", "request r finished (length): 2 output tokens",
        "request r: 2 prompt tokens: 'prompt prompt '", "request r finished (length): 2 output tokens: 't0 t1 '",
    ]


def test_chat_template_is_a_file_or_the_template_itself(tmp_path, tiny_model):
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}<{{ m.content }}>{% endfor %}")
    assert chat_template_text(str(path)) == path.read_text()
    assert chat_template_text("{{ messages }}") == "{{ messages }}"
    tokenizer = load_tokenizer(ServerArgs(model_path=tiny_model, chat_template=str(path)))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<hi>"


def test_tokenizer_mode_slow_asks_for_the_python_tokenizer(tiny_model, monkeypatch):
    from transformers import AutoTokenizer

    asked = {}
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda path, **kwargs: asked.update(kwargs) or
                        SimpleNamespace())
    load_tokenizer(ServerArgs(model_path=tiny_model, tokenizer_mode="slow"))
    assert asked["use_fast"] is False
