"""Structured output through the HTTP server: SGLang's grammar sampling parameters on /generate, OpenAI
`response_format` and `tools` + `tool_choice` (through the `openai` package), and the 400s of bad grammars."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Literal

import aiohttp

import jsonschema
import pytest
from pydantic import BaseModel, Field
from server_util import API_KEY, parse_prometheus

openai = pytest.importorskip("openai")  # the GPU image has no openai client; CI installs it

POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "label": {"type": "string", "maxLength": 6}},
         "required": ["x", "label"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"]}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=30)
    name: str = Field(max_length=8)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def model_name(server) -> str:
    return server.get("/v1/models").json()["data"][0]["id"]


def generate(server, **sampling_params):
    return server.post("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 80, **sampling_params}})


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_json_schema(server, temperature):
    reply = generate(server, json_schema=json.dumps(POINT), temperature=temperature)
    assert reply.status == 200, reply.body
    jsonschema.validate(json.loads(reply.json()["text"]), POINT)


def test_generate_regex_and_ebnf(server):
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", generate(server, regex=r"[0-9]{3}-[a-z]{2}", temperature=1.0)
                        .json()["text"])
    assert generate(server, ebnf='root ::= "yes" | "no"', temperature=1.0).json()["text"] in ("yes", "no")


@pytest.mark.parametrize("params, message", [
    ({"json_schema": '{"type": "nonsense"}'}, "invalid json_schema"),
    ({"regex": "("}, "invalid regex"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one of"),
])
def test_bad_grammars_are_400_and_the_server_keeps_serving(server, params, message):
    reply = generate(server, **params)
    assert reply.status == 400 and message in reply.body.decode()
    assert re.fullmatch("[0-9]{4}", generate(server, regex="[0-9]{4}").json()["text"])


def test_openai_parse_with_a_pydantic_model(server, client):
    result = client.chat.completions.parse(model=model_name(server), messages=MESSAGES, response_format=Pet,
                                           temperature=1.0, max_tokens=80)
    pet = result.choices[0].message.parsed
    assert isinstance(pet, Pet) and result.choices[0].finish_reason == "stop"


def test_completions_json_object_with_n_and_logprobs(server, client):
    result = client.completions.create(model=model_name(server), prompt="hi", n=2, logprobs=1, max_tokens=200,
                                       temperature=1.0, extra_body={"response_format": {"type": "json_object"}})
    assert len(result.choices) == 2
    for choice in result.choices:
        assert choice.text.startswith("{") and len(choice.logprobs.tokens) > 0
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)


def test_sglang_regex_and_ebnf_on_the_openai_routes(server, client):
    text = client.completions.create(model=model_name(server), prompt="hi", max_tokens=20, temperature=1.0,
                                     extra_body={"regex": "[a-c]{4}"}).choices[0].text
    content = client.chat.completions.create(model=model_name(server), messages=MESSAGES, max_tokens=20,
                                             extra_body={"ebnf": 'root ::= "yes" | "no"'}).choices[0].message.content
    assert re.fullmatch("[a-c]{4}", text) and content in ("yes", "no")
    with pytest.raises(openai.BadRequestError, match="at most one of"):
        client.chat.completions.create(model=model_name(server), messages=MESSAGES, extra_body={"regex": "a"},
                                       response_format={"type": "json_object"})


def test_response_format_json_schema_and_stop_strings(server, client):
    result = client.chat.completions.create(
        model=model_name(server), messages=MESSAGES, max_tokens=80, temperature=0, stop=['"label"'],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": POINT, "strict": True}})
    assert result.choices[0].message.content.startswith('{"x": ')
    assert result.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_gives_parseable_calls(server, client, parallel):
    result = client.chat.completions.create(model=model_name(server), messages=MESSAGES, tools=[WEATHER, CLOCK],
                                            tool_choice="required", parallel_tool_calls=parallel, temperature=1.0,
                                            max_tokens=200)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert parallel or len(choice.message.tool_calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"


def test_named_tool_choice_calls_that_function(server, client):
    result = client.chat.completions.create(
        model=model_name(server), messages=MESSAGES, tools=[WEATHER, CLOCK], temperature=0, max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = result.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and result.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_tool_calls_match_the_blocking_answer(server, client, n):
    request = dict(model=model_name(server), messages=MESSAGES, tools=[WEATHER, CLOCK], temperature=0, n=n,
                   tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=60)
    blocking = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True))
    for index in range(n):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        start, *fragments = [call for choice in mine for call in choice.delta.tool_calls or []]
        expected = blocking.choices[index].message.tool_calls[0]
        assert (start.index, start.function.name, start.function.arguments) == (0, "get_time", "")
        assert "".join(f.function.arguments for f in fragments) == expected.function.arguments
        assert mine[-1].finish_reason == "tool_calls"


def test_a_tool_call_answer_goes_back_through_the_template(server, client):
    earlier = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}]}
    result = client.chat.completions.create(
        model=model_name(server), max_tokens=5, temperature=0, tools=[CLOCK], tool_choice="none",
        messages=[*MESSAGES, earlier, {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}])
    assert result.choices[0].message.tool_calls is None


@pytest.mark.parametrize("body, message", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "invalid json_schema"),
    ({"response_format": {"type": "grammar"}}, "not supported"),
])
def test_bad_structured_chat_requests_are_400(server, body, message):
    reply = server.post("/v1/chat/completions", {"model": model_name(server), "messages": MESSAGES, **body})
    assert reply.status == 400 and message in reply.body.decode(), reply.body


def test_tools_on_completions_are_refused(server):
    reply = server.post("/v1/completions", {"model": model_name(server), "prompt": "x", "tools": [WEATHER]})
    assert reply.status == 400 and "tools is not supported" in reply.body.decode()


def test_an_abort_mid_constrained_stream_frees_the_pool(server):
    async def read_a_little_then_leave() -> None:
        body = {"text": "hello", "stream": True,
                "sampling_params": {"max_new_tokens": 200, "regex": "[a-z]{190}", "temperature": 1.0}}
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
            async with session.post(f"{server.url}/generate", json=body) as response:
                assert response.status == 200
                for _ in range(3):
                    await response.content.readuntil(b"\n\n")

    asyncio.run(read_a_little_then_leave())
    deadline = time.monotonic() + 15
    while not (stats := server.get("/get_server_info").json()["scheduler"])["kv_pool_fully_free"] \
            or stats["num_running"] or stats["grammar_waiting"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


def test_grammar_metrics(server):
    before = parse_prometheus(server.get("/metrics").body.decode())
    generate(server, regex="[0-9]{5}")
    generate(server, regex="[0-9]{5}")
    after = parse_prometheus(server.get("/metrics").body.decode())
    assert after["pdserve_constrained_requests_total"] == before.get("pdserve_constrained_requests_total", 0) + 2
    assert after["pdserve_grammar_cache_hits_total"] >= before.get("pdserve_grammar_cache_hits_total", 0) + 1
    assert after["pdserve_grammar_masked_rows_total"] >= before.get("pdserve_grammar_masked_rows_total", 0) + 12
    rows = after["pdserve_grammar_masked_rows_total"] - before.get("pdserve_grammar_masked_rows_total", 0)
    steps = after["pdserve_grammar_masked_steps_total"] - before.get("pdserve_grammar_masked_steps_total", 0)
    assert steps == rows  # one request at a time: one masked row per step
    assert after["pdserve_grammar_compile_seconds_total"] > 0 and after["pdserve_grammar_waiting_reqs"] == 0
