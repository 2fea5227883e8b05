"""Unit tests of the server's pieces that need no running server: messages, detokenizer, metrics, protocol."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import msgpack
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_util import parse_prometheus
from transformers import AutoTokenizer

from pdserve.config import ServerArgs
from pdserve.sampling_params import SamplingParams, SamplingParamsError
from pdserve.detokenizer.process import IncrementalDetokenizer
from pdserve.server.generation import settle_bootstrap
from pdserve.server.openai_api import chat_logprobs
from pdserve.server.http_common import ApiError
from pdserve.messages import (
    BatchTokenOut,
    DecodeSettings,
    GetStatsReply,
    MessageError,
    TokenizedGenerateReq,
    TokenOut,
    decode,
    encode,
)
from pdserve.disagg.transfer_stats import TransferStats
from pdserve.server.metrics import LATENCY_BUCKETS, ServerMetrics
from pdserve.server.schemas import (ChatCompletionRequest, CompletionRequest, GenerateReqInput, bootstrap_for,
                                    sglang_sampling_params)
from pdserve.server.tokenizer_manager import GenerateRequest
from pdserve.tokenizer import TokenBytes, load_tokenizer, pack_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


# --- messages -------------------------------------------------------------------------------------


def test_messages_round_trip_nested_and_optional_fields():
    batch = BatchTokenOut([
        TokenOut("a", [1, 2], None, 3, 2, 0, [-0.5, -1.0], [[[1, -0.5]], [[2, -1.0]]]),
        TokenOut("b", [], {"type": "stop", "matched": "x"}, 4, 1, 2, input_logprobs=[None, -2.0]),
    ])
    assert decode(encode(batch)) == batch
    req = TokenizedGenerateReq("r", [5, 6], SamplingParams(temperature=0.0).to_dict(), bootstrap_room=2**63 - 1)
    assert decode(encode(req)) == req
    assert decode(encode(GetStatsReply(7, {"num_running": 1, "kv": 0.5}))).stats == {"num_running": 1, "kv": 0.5}


@pytest.mark.parametrize("payload", [
    b"\xc1",  # never-used msgpack byte
    msgpack.packb({"__type__": "Popen", "args": ["sh"]}),  # not a registered message
    msgpack.packb({"__type__": "AbortReq", "rid": "x", "evil": 1}),  # unknown field
    msgpack.packb({"rid": "x"}),  # untagged map
    msgpack.packb([1, 2, 3]),
])
def test_malformed_messages_are_rejected(payload):
    with pytest.raises(MessageError):
        decode(payload)


def test_unregistered_objects_cannot_be_sent():
    with pytest.raises(MessageError):
        encode({"rid": "x"})


# --- incremental detokenization -------------------------------------------------------------------


def _stream(detok: IncrementalDetokenizer, rid: str, ids: list[int], final: dict) -> list[str]:
    texts = []
    for i, token in enumerate(ids):
        finish = final if i == len(ids) - 1 else None
        out = TokenOut(rid, [token], finish, 1, i + 1, 0)
        texts.extend(o.text for o in detok.process(BatchTokenOut([out])).outputs)
    return texts


def test_multibyte_characters_are_never_split(tokenizer):
    text = "请介绍一下你自己 — naïve café ✓ 😀"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split()), "the test needs characters spread over several tokens"
    detok = IncrementalDetokenizer(tokenizer)
    detok.register(DecodeSettings("r", True, [], False))
    pieces = _stream(detok, "r", ids, {"type": "length"})
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert sum(1 for p in pieces if p) > 5, "text must flow incrementally, not all at the end"
    assert detok.states == {}


def test_stop_string_and_its_prefix_are_never_returned(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog")
    detok = IncrementalDetokenizer(tokenizer)
    detok.register(DecodeSettings("r", True, ["over the"], False))
    pieces = _stream(detok, "r", ids, {"type": "stop", "matched": "over the"})
    streamed = ""
    for piece in pieces:
        streamed += piece
        assert "The quick brown fox jumps ".startswith(streamed), streamed  # never a piece of "over the"
    assert streamed == "The quick brown fox jumps "


def test_held_back_text_is_released_when_it_stops_matching(tokenizer):
    ids = tokenizer.encode("dog and dot")
    detok = IncrementalDetokenizer(tokenizer)
    detok.register(DecodeSettings("r", True, ["dots!"], False))
    pieces = _stream(detok, "r", ids, {"type": "length"})
    assert "".join(pieces) == "dog and dot"


def test_logprob_entries_carry_token_text(tokenizer):
    ids = tokenizer.encode("hello world")
    detok = IncrementalDetokenizer(tokenizer)
    detok.register(DecodeSettings("r", True, [], True))
    out = TokenOut("r", ids, {"type": "length"}, 1, len(ids), 0, [-0.1] * len(ids), [[[ids[0], -0.1]]] * len(ids))
    result = detok.process(BatchTokenOut([out])).outputs[0]
    assert [e[1] for e in result.output_logprobs] == ids
    assert "".join(e[2] for e in result.output_logprobs) == "hello world"
    assert result.output_top_logprobs[0] == [[-0.1, ids[0], tokenizer.decode([ids[0]])]]


def partial_character_token(tokenizer) -> int:
    """A token of "中" (three UTF-8 bytes) that holds only part of the character."""
    ids = tokenizer.encode("中", add_special_tokens=False)
    assert len(ids) > 1
    return ids[0]


REMOTE_TOKENIZER = """
from transformers import PreTrainedTokenizerFast

class RemoteTokenizer(PreTrainedTokenizerFast):
    pass
"""
UNPACK_AND_DETOKENIZE = """
import json, sys
from pdserve.config import ServerArgs
from pdserve.detokenizer.process import IncrementalDetokenizer
from pdserve.messages import BatchTokenOut, DecodeSettings, TokenOut
from pdserve.tokenizer import unpack_tokenizer
path, remote, ids = sys.argv[1], sys.argv[2] == "True", json.loads(sys.argv[3])
with open(path, "rb") as packed:
    tokenizer = unpack_tokenizer(packed.read(), ServerArgs(model_path="unused", trust_remote_code=remote))
detok = IncrementalDetokenizer(tokenizer)
detok.register(DecodeSettings("r", True, [], False))
out = detok.process(BatchTokenOut([TokenOut("r", ids, {"type": "length"}, 1, len(ids), 0)])).outputs[0]
print(json.dumps([out.text, type(tokenizer).__name__, tokenizer.chat_template, "torch" in sys.modules]))
"""


def remote_code_model(tiny_model: str, folder) -> str:
    """The tiny model with a tokenizer class of its own, loaded as remote code (transformers' module cache)."""
    shutil.copytree(tiny_model, folder)
    (folder / "remote_tokenizer.py").write_text(REMOTE_TOKENIZER)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="RemoteTokenizer",
                  auto_map={"AutoTokenizer": [None, "remote_tokenizer.RemoteTokenizer"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("remote_code", [False, True])
def test_the_detokenizer_runs_on_the_servers_packed_tokenizer_without_torch(tiny_model, tmp_path, remote_code):
    """The server hands the detokenizer the tokenizer it loaded, packed: a fresh process unpacks it (its chat
    template and a remote-code class too) and detokenizes with it, and never imports torch (AutoTokenizer would)."""
    model = remote_code_model(tiny_model, tmp_path / "remote") if remote_code else tiny_model
    tokenizer = load_tokenizer(ServerArgs(model_path=model, trust_remote_code=remote_code, chat_template="{{ 1 }}"))
    packed = tmp_path / "tokenizer.pickle"
    packed.write_bytes(pack_tokenizer(tokenizer))
    ids = tokenizer.encode("hello world")
    probe = [sys.executable, "-c", UNPACK_AND_DETOKENIZE, str(packed), str(remote_code), json.dumps(ids)]
    out = subprocess.run(probe, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == ["hello world", type(tokenizer).__name__, "{{ 1 }}", False]


def test_a_token_holding_part_of_a_character_has_its_real_bytes(tokenizer):
    token_id = partial_character_token(tokenizer)
    token_bytes = TokenBytes(tokenizer)
    assert token_bytes(token_id, tokenizer.decode([token_id])) == "中".encode()[:2]
    whole = tokenizer.encode("é 中", add_special_tokens=False)
    assert b"".join(token_bytes(t, tokenizer.decode([t])) for t in whole) == "é 中".encode()


def test_chat_logprobs_carry_bytes_not_the_replacement_character(tokenizer):
    token_id = partial_character_token(tokenizer)
    content = chat_logprobs([[-0.5, token_id, "\ufffd"]], [[[-0.5, token_id, "\ufffd"]]], TokenBytes(tokenizer))
    assert content[0]["token"] == "\ufffd"
    assert content[0]["bytes"] == content[0]["top_logprobs"][0]["bytes"] == list("中".encode()[:2])


# --- metrics --------------------------------------------------------------------------------------


def test_metrics_render_valid_prometheus_text():
    metrics = ServerMetrics("m")
    metrics.request_started()
    metrics.observe_ttft(0.02)
    metrics.observe_inter_token(0.01, 3)
    metrics.request_finished(TokenOut("r", [1], {"type": "length"}, 5, 4, 2), 0.3)
    text = metrics.render({"num_running": 2, "kv_used_tokens": 32, "kv_total_tokens": 128,
                           "prefix_hit_tokens": 1, "prefix_query_tokens": 4}, in_flight=1)
    samples = parse_prometheus(text)
    assert samples["pdserve_requests_finished_total{finish_reason=\"length\"}"] == 1
    assert samples["pdserve_inter_token_latency_seconds_count"] == 3
    assert samples["pdserve_time_to_first_token_seconds_bucket{le=\"0.025\"}"] == 1
    assert samples["pdserve_time_to_first_token_seconds_bucket{le=\"0.01\"}"] == 0
    assert samples["pdserve_kv_cache_usage_ratio"] == 0.25
    assert samples["pdserve_prefix_cache_hit_rate"] == 0.25
    assert samples["pdserve_generation_tokens_total"] == 4


def test_sglang_names_carry_pdserves_values_with_the_model_name():
    metrics = ServerMetrics("qwen")
    metrics.observe_ttft(0.02)
    metrics.request_finished(TokenOut("r", [1], {"type": "length"}, 5, 4, 2), 0.3)
    samples = parse_prometheus(metrics.render({"num_running": 3, "num_running_reqs": 4, "num_waiting": 2,
                                               "decode_step_ms": 8.0, "kv_used_tokens": 32, "kv_total_tokens": 128,
                                               "prefix_hit_tokens": 1, "prefix_query_tokens": 4}, in_flight=1))
    label = '{model_name="qwen"}'
    assert samples["sglang:prompt_tokens_total" + label] == samples["pdserve_prompt_tokens_total"] == 5
    assert samples["sglang:generation_tokens_total" + label] == 4
    assert samples["sglang:num_running_reqs" + label] == 3 and samples["sglang:num_queue_reqs" + label] == 2
    assert samples["sglang:token_usage" + label] == samples["sglang:cache_hit_rate" + label] == 0.25
    assert samples["sglang:gen_throughput" + label] == samples["pdserve_decode_tokens_per_second"] == 500.0
    assert samples['sglang:time_to_first_token_seconds_bucket{le="0.025",model_name="qwen"}'] == 1
    assert samples["sglang:e2e_request_latency_seconds_sum" + label] == 0.3


def test_kv_transfer_metrics_render_from_the_roles_stats():
    stats = TransferStats("decode")
    stats.moved(4096)
    stats.completed(0.003)
    stats.completed(2.0)
    stats.failed("peer_dead")
    text = ServerMetrics("m").render({"kv_transfer": stats.snapshot({"bootstrap": 2, "transfer": 1})}, in_flight=0)
    families = {family.name: family for family in text_string_to_metric_families(text)}
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert values[("pdserve_kv_transfer_bytes_total", (("role", "decode"),))] == 4096
    assert values[("pdserve_kv_transfers_total", (("role", "decode"),))] == 2
    assert families["pdserve_kv_transfer_duration_seconds"].type == "histogram"
    assert values[("pdserve_kv_transfer_duration_seconds_bucket", (("le", "0.0025"), ("role", "decode")))] == 0
    assert values[("pdserve_kv_transfer_duration_seconds_bucket", (("le", "0.005"), ("role", "decode")))] == 1
    assert values[("pdserve_kv_transfer_duration_seconds_bucket", (("le", "+Inf"), ("role", "decode")))] == 2
    assert values[("pdserve_kv_transfer_duration_seconds_sum", (("role", "decode"),))] == 2.003
    assert values[("pdserve_kv_transfer_failures_total", (("reason", "peer_dead"), ("role", "decode")))] == 1
    assert values[("pdserve_pd_queue_requests", (("queue", "bootstrap"), ("role", "decode")))] == 2
    assert values[("pdserve_pd_queue_requests", (("queue", "transfer"), ("role", "decode")))] == 1


def test_metrics_parse_with_the_prometheus_parser():
    metrics = ServerMetrics("m")
    metrics.http_error(400)
    metrics.observe_inter_token(0.003, 2)
    text = metrics.render({"kv_used_tokens": 1, "kv_total_tokens": 4}, in_flight=3)
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert families["pdserve_http_errors"].type == "counter"
    assert [(s.labels, s.value) for s in families["pdserve_http_errors"].samples] == [({"status": "400"}, 1.0)]
    inter_token = families["pdserve_inter_token_latency_seconds"]
    assert inter_token.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in inter_token.samples if s.name.endswith("_bucket")}
    assert list(buckets) == [str(b) for b in LATENCY_BUCKETS] + ["+Inf"]
    assert buckets["0.0025"] == 0 and buckets["0.005"] == 2 and buckets["+Inf"] == 2
    assert families["pdserve_requests_in_flight"].samples[0].value == 3
    assert families["pdserve_kv_cache_usage_ratio"].samples[0].value == 0.25


# --- protocol -------------------------------------------------------------------------------------


def test_top_level_sampling_fields_are_honoured_and_nested_ones_win():
    body = GenerateReqInput.model_validate({"text": "x", "max_new_tokens": 32, "temperature": 0.7})
    params = sglang_sampling_params(body, body.sampling_params)
    assert (params.max_tokens, params.temperature) == (32, 0.7)
    body = GenerateReqInput.model_validate(
        {"text": "x", "max_new_tokens": 32, "sampling_params": {"max_new_tokens": 5, "stop": "\n"}})
    params = sglang_sampling_params(body, body.sampling_params)
    assert (params.max_tokens, params.stop) == (5, ["\n"])
    with pytest.raises(SamplingParamsError):
        sglang_sampling_params(GenerateReqInput.model_validate({"text": "x", "top_p": 0}), None)


def test_batch_size_detection():
    assert GenerateReqInput.model_validate({"text": "a"}).batch_size is None
    assert GenerateReqInput.model_validate({"text": ["a", "b"]}).batch_size == 2
    assert GenerateReqInput.model_validate({"input_ids": [1, 2, 3]}).batch_size is None
    assert GenerateReqInput.model_validate({"input_ids": [[1], [2]]}).batch_size == 2


def test_openai_unsupported_features_are_named():
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate(base).unsupported_feature() is None
    functions = {**base, "functions": [{"name": "f"}]}
    assert ChatCompletionRequest.model_validate(functions).unsupported_feature() == "functions"
    completion = {"model": "m", "prompt": "hi", "tools": [{"type": "function"}]}
    assert CompletionRequest.model_validate(completion).unsupported_feature() == "tools"
    assert ChatCompletionRequest.model_validate({**base, "logit_bias": None}).unsupported_feature() is None


def test_bootstrap_fields_per_item_and_range():
    body = GenerateReqInput.model_validate(
        {"text": ["a", "b"], "bootstrap_host": "10.0.0.1", "bootstrap_port": [8998, 8999], "bootstrap_room": [1, 2]})
    assert bootstrap_for(body, 1) == ("10.0.0.1", 8999, 2)
    with pytest.raises(ValueError):
        bootstrap_for(GenerateReqInput.model_validate({"text": "a", "bootstrap_room": 2**63}), 0)


def test_a_scalar_room_gives_each_item_its_own_room():
    body = GenerateReqInput.model_validate({"text": ["a", "b", "c"], "bootstrap_room": 2**63 - 2})
    assert [bootstrap_for(body, i)[2] for i in range(3)] == [2**63 - 2, 2**63 - 1, 0]
    with pytest.raises(ValueError):
        bootstrap_for(GenerateReqInput.model_validate({"text": ["a", "b"], "bootstrap_room": -1}), 1)


def test_sglang_fields_are_accepted_at_their_neutral_value():
    body = GenerateReqInput.model_validate({
        "text": "a", "lora_path": None, "return_routed_experts": False, "custom_logit_processor": None,
        "image_data": [], "routed_dp_rank": 0, "session_id": "s", "priority": None, "log_metrics": False,
        "lora_id": [None, None], "return_logprob": None, "logprob_start_len": None,
        "sampling_params": {"n": 1, "regex": None, "spaces_between_special_tokens": True, "stream_interval": 4}})
    assert body.unsupported_feature() is None


@pytest.mark.parametrize("field, value", [
    ("lora_path", "my-adapter"), ("lora_path", [None, "a"]), ("return_routed_experts", True),
    ("custom_logit_processor", "{}"), ("image_data", "http://x/cat.png"), ("routed_dp_rank", 1), ("priority", 3),
    ("return_hidden_states", True), ("session_params", {"id": "s"}),
])
def test_sglang_fields_asking_for_a_missing_feature_are_named(field, value):
    body = GenerateReqInput.model_validate({"text": "a", field: value})
    assert body.unsupported_feature() == f"{field}={value!r}"


def test_sglang_sampling_fields_asking_for_a_missing_feature_are_named():
    body = GenerateReqInput.model_validate({"text": "a", "sampling_params": [{}, {"stop_regex": "[ab]+"}]})
    assert body.unsupported_feature() == "stop_regex='[ab]+'"
    assert GenerateReqInput.model_validate({"text": "a", "sampling_params": {"n": 2}}).unsupported_feature() == "n=2"


def test_unknown_fields_are_still_refused():
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        GenerateReqInput.model_validate({"text": "a", "lora_pth": None})


def test_pd_server_requires_bootstrap_fields():
    """A prefill needs them; a decode takes none (it prefills locally) or all, never half."""
    request = GenerateRequest("r", [1], SamplingParams())
    settle_bootstrap(ServerArgs(model_path="m"), request)  # colocated: fine without them
    prefill_args = ServerArgs(model_path="m", disaggregation_mode="prefill")
    decode_args = ServerArgs(model_path="m", disaggregation_mode="decode")
    with pytest.raises(ApiError) as err:
        settle_bootstrap(prefill_args, request)
    assert err.value.status == 400 and "bootstrap_host" in err.value.message
    settle_bootstrap(decode_args, request)  # conditional disaggregation: the decode server prefills it
    request.bootstrap_host = "10.0.0.1"
    with pytest.raises(ApiError):
        settle_bootstrap(decode_args, request)
    request.bootstrap_room = 7
    settle_bootstrap(prefill_args, request)
    settle_bootstrap(decode_args, request)
