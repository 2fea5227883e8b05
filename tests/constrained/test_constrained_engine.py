"""Constrained decoding in the engine (offline `LLM`, tiny random-weight model on the CPU): every grammar kind gives
output that parses, bad grammars and slow compiles fail cleanly, and grammars work with sampling, logprobs, stop
strings, ignore_eos and both decode paths (overlap scheduling on and off)."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from pdserve import LLM, SamplingParams
from pdserve.scheduler.request import Req

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "home": {"$ref": "#/$defs/place"},
    },
    "required": ["name", "age", "role", "tags", "home"],
    "$defs": {"place": {"type": "object", "required": ["city", "zip"], "properties": {
        "city": {"type": "string", "maxLength": 6},
        "zip": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99999}, {"type": "null"}]}}}},
}
PROMPTS = ["hello world", "the quick brown fox", "a", "json please"]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def llm(request, tiny_model):
    engine = LLM(tiny_model, device="cpu", dtype="float32", page_size=4, max_total_tokens=4096,
                 chunked_prefill_size=64, skip_server_warmup=True, disable_overlap_schedule=not request.param)
    yield engine
    engine.shutdown()


def generate(llm, prompts=PROMPTS, **params):
    return llm.generate(prompts, SamplingParams(**{"max_tokens": 120, **params}), use_tqdm=False)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(llm, temperature):
    for out in generate(llm, temperature=temperature, json_schema=json.dumps(PERSON)):
        assert out.finish_reason["type"] == "stop", out
        jsonschema.validate(json.loads(out.text), PERSON)
        assert json.dumps(json.loads(out.text), ensure_ascii=False) == out.text  # one fixed separator, no blanks
    assert llm.scheduler.kv_pool_is_fully_free()


def test_json_object_is_a_top_level_object(llm):
    for out in generate(llm, temperature=1.0, json_schema='{"type": "object"}', max_tokens=200):
        assert out.text.startswith("{")  # a cut-off one is a prefix of an object
        if out.finish_reason["type"] == "stop":
            assert isinstance(json.loads(out.text), dict)


def test_regex_matches_fully(llm):
    pattern = r"(cat|dog)-[0-9]{2,4}"
    for out in generate(llm, temperature=1.0, regex=pattern):
        assert re.fullmatch(pattern, out.text), out.text


def test_ebnf_output_parses_with_the_grammar(llm):
    grammar = 'root ::= "SELECT " col (", " col)* " FROM t"\ncol ::= "a" | "b" | "c"'
    for out in generate(llm, temperature=1.0, ebnf=grammar):
        assert re.fullmatch(r"SELECT [abc](, [abc])* FROM t", out.text), out.text


def test_structural_tag_constrains_the_tagged_part(llm):
    tag = {"type": "structural_tag", "triggers": ["<f>"],
           "structures": [{"begin": "<f>", "schema": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                     "required": ["x"]}, "end": "</f>"}]}
    outs = generate(llm, temperature=0.0, structural_tag=json.dumps(tag), max_tokens=30)
    for out in outs:
        for body in re.findall(r"<f>(.*?)</f>", out.text, flags=re.S):
            assert isinstance(json.loads(body)["x"], int)


def test_strings_hold_no_raw_control_characters(llm):
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 30}}, "required": ["s"]}
    for out in generate(llm, prompts=PROMPTS * 2, temperature=2.0, json_schema=json.dumps(schema)):
        assert not any(ord(c) < 32 for c in json.loads(out.text)["s"])


def test_grammar_end_stops_the_request_even_with_ignore_eos(llm):
    out = generate(llm, prompts=["x"], temperature=1.0, regex="yes|no", ignore_eos=True, max_tokens=50)[0]
    assert out.text in ("yes", "no") and out.finish_reason["type"] == "stop"


def test_logprobs_and_seeded_sampling_with_a_grammar(llm):
    first, again = (generate(llm, prompts=["x"], temperature=1.0, seed=7, logprobs=2, regex="[a-z]{5}")[0]
                    for _ in range(2))
    assert first.token_ids == again.token_ids and re.fullmatch("[a-z]{5}", first.text)
    assert len(first.logprobs) == len(first.token_ids) and all(len(t) == 2 for t in first.top_logprobs)


def test_stop_string_cuts_constrained_output(llm):
    out = generate(llm, prompts=["x"], temperature=0.0, regex="abc-def-ghi", stop=["-def"])[0]
    assert out.text == "abc" and out.finish_reason == {"type": "stop", "matched": "-def"}


def test_constrained_and_free_requests_share_a_batch(llm):
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = llm.generate(["hello world"], free, use_tqdm=False)[0].token_ids
    mixed = llm.generate(["hello world", "x"], [free, SamplingParams(temperature=0.0, max_tokens=40, regex="[0-9]{9}")],
                         use_tqdm=False)
    assert mixed[0].token_ids == alone and re.fullmatch("[0-9]{9}", mixed[1].text)


@pytest.mark.parametrize("kind, text, reason", [
    ("json_schema", '{"type": "nonsense"}', 'invalid json_schema: Unsupported type "nonsense"'),
    ("json_schema", "{not json", "invalid json_schema"),
    ("regex", "(", "invalid regex"),
    ("ebnf", "root ::= ", "invalid ebnf"),
])
def test_a_bad_grammar_fails_with_400_and_the_engine_keeps_serving(llm, kind, text, reason):
    out = generate(llm, prompts=["x"], **{kind: text})[0]
    assert out.finish_reason["type"] == "abort" and out.finish_reason["status_code"] == 400
    assert out.finish_reason["message"].startswith(reason)
    assert re.fullmatch("[0-9]{3}", generate(llm, prompts=["x"], regex="[0-9]{3}")[0].text)
    assert llm.scheduler.kv_pool_is_fully_free()


def test_a_slow_compile_times_out_with_400(llm, monkeypatch):
    queue = llm.scheduler.grammar_queue
    monkeypatch.setattr(queue, "args", queue.args.replace(grammar_compile_timeout_s=0.05))
    queue._compiler()  # built before the patch below
    monkeypatch.setattr(queue.compiler, "compile", lambda spec: time.sleep(0.5))
    outs = generate(llm, prompts=["x", "y"], regex="slow[0-9]")
    assert all(o.finish_reason["status_code"] == 400 and "did not compile within 0.05 s" in o.finish_reason["message"]
               for o in outs)


def test_two_grammars_in_one_request_are_refused():
    with pytest.raises(ValueError, match="at most one of json_schema, regex, ebnf, structural_tag"):
        SamplingParams(regex="a", ebnf='root ::= "a"')


def test_an_abort_while_the_grammar_compiles_ends_the_request(llm, monkeypatch):
    queue, sched = llm.scheduler.grammar_queue, llm.scheduler
    queue._compiler()
    monkeypatch.setattr(queue.compiler, "compile", lambda spec: time.sleep(0.3))
    sched.add_request(Req.of("waits", [5, 6, 7], SamplingParams(regex="abort[0-9]")))
    sched.abort_request("waits")
    (out,) = sched.step()
    assert out.rid == "waits" and out.finish_reason["type"] == "abort"
    assert not queue.pending and not sched.has_work() and sched.kv_pool_is_fully_free()
