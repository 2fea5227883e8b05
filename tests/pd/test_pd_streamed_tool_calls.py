"""Streamed tool calls through the OpenAI Python SDK, against the colocated server and through the PD router: a
call's start (id, name) comes first, then its arguments in fragments, and the SDK's accumulated stream equals the
blocking answer. `tool_choice: auto` is steered with SGLang's `ebnf` extension (a random-weight model writes no call
on its own)."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
from cluster_util import Proc, wait_kv_free
from prometheus_client.parser import text_string_to_metric_families

openai = pytest.importorskip("openai")  # the GPU image has no openai client; CI installs it

pytestmark = pytest.mark.timeout(900)  # the first test also pays for starting the servers

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")
# content, then two calls (Qwen's <tool_call> blocks), each city a few sampled letters
CONTENT_THEN_TWO_CALLS = r'''
root ::= "Let me check. " call "\n" call
call ::= "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"" [a-z]{4,10} "\", \"unit\": \"c\"}}\n</tool_call>"
'''


@pytest.fixture(params=["colocated", "pd"])
def target(request, session_servers) -> Proc:
    if request.param == "colocated":
        return session_servers["colocated"]
    return session_servers["clusters"]["tcp"].router


@pytest.fixture
def decoder(target, session_servers) -> Proc:
    """The server that decodes the target's requests."""
    colocated = session_servers["colocated"]
    return colocated if target is colocated else session_servers["clusters"]["tcp"].decode


@pytest.fixture(autouse=True)
def pools_free_after(session_servers):
    yield
    wait_kv_free([session_servers["colocated"], *session_servers["clusters"]["tcp"].servers])


def client_of(proc: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=120)


def request_of(proc: Proc, **fields) -> dict:
    model = proc.get("/v1/models").json()["data"][0]["id"]
    return {"model": model, "messages": MESSAGES, "tools": [WEATHER, CLOCK], "max_tokens": 120, **fields}


def streamed(client: openai.OpenAI, request: dict):
    """The raw chunks and the SDK's accumulated answer of one streamed request."""
    with client.chat.completions.stream(**request) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        return chunks, stream.get_final_completion()


def call_deltas(chunks) -> list:
    return [call for chunk in chunks for choice in chunk.choices for call in choice.delta.tool_calls or []]


def summary(message) -> list[tuple]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def check_calls(message, count: int) -> None:
    ids = [c.id for c in message.tool_calls]
    assert len(ids) == count and len(set(ids)) == count and all(CALL_ID.fullmatch(i) for i in ids), ids
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_streamed_named_call_equals_the_blocking_one(target):
    client = client_of(target)
    request = request_of(target, temperature=0, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    blocking = client.chat.completions.create(**request).choices[0]
    chunks, final = streamed(client, request)
    (choice,) = final.choices
    assert summary(choice.message) == summary(blocking.message) and choice.message.content is None
    assert choice.finish_reason == blocking.finish_reason == "tool_calls"
    check_calls(choice.message, 1)
    deltas = call_deltas(chunks)
    start, *fragments = deltas
    assert (start.index, start.id, start.type, start.function.name, start.function.arguments) == \
           (0, choice.message.tool_calls[0].id, "function", "get_weather", "")
    assert len(fragments) > 1 and all(f.id is None and f.function.name is None and f.index == 0 for f in fragments)
    assert "".join(f.function.arguments for f in fragments) == blocking.message.tool_calls[0].function.arguments


def test_required_calls_stream_as_the_blocking_answer(target):
    client = client_of(target)
    request = request_of(target, temperature=0, tool_choice="required")
    blocking = client.chat.completions.create(**request).choices[0]
    chunks, final = streamed(client, request)
    assert summary(final.choices[0].message) == summary(blocking.message)
    check_calls(final.choices[0].message, len(blocking.message.tool_calls))
    assert not any(choice.delta.content for chunk in chunks for choice in chunk.choices)


def test_auto_streams_content_then_two_parallel_calls(target):
    client = client_of(target)
    request = request_of(target, temperature=1.0, seed=7, tool_choice="auto", max_tokens=400,
                         extra_body={"ebnf": CONTENT_THEN_TWO_CALLS})
    chunks, final = streamed(client, request)
    (choice,) = final.choices
    assert choice.message.content == "Let me check." and choice.finish_reason == "tool_calls"
    check_calls(choice.message, 2)
    starts = [call for call in call_deltas(chunks) if call.id is not None]
    assert [(call.index, call.function.name) for call in starts] == [(0, "get_weather"), (1, "get_weather")]
    first_call = next(i for i, chunk in enumerate(chunks) if chunk.choices and chunk.choices[0].delta.tool_calls)
    assert all(not chunk.choices[0].delta.content for chunk in chunks[first_call:] if chunk.choices)
    blocking = client.chat.completions.create(**request).choices[0]  # the same seed: the same text
    assert (blocking.message.content, summary(blocking.message)) == (choice.message.content, summary(choice.message))


def aborted(proc: Proc) -> float:
    """Requests the server ended with finish_reason abort."""
    return sum(sample.value for family in text_string_to_metric_families(proc.get("/metrics").body.decode())
               for sample in family.samples
               if sample.name == "pdserve_requests_finished_total" and sample.labels["finish_reason"] == "abort")


def test_an_abort_mid_tool_call_stream_frees_every_pool(target, decoder):
    client, aborted_before = client_of(target), aborted(decoder)
    request = request_of(target, temperature=1.0, tool_choice="auto", max_tokens=400, extra_body={
        "ebnf": 'root ::= "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"" '
                '[a-z]{300} "\\"}}\\n</tool_call>"'})
    stream = client.chat.completions.create(**request, stream=True)
    seen = []
    for chunk in stream:
        seen += call_deltas([chunk])
        if len(seen) >= 3:
            break
    stream.close()
    assert seen[0].function.name == "get_weather" and seen[1].function.arguments
    deadline = time.monotonic() + 10
    while aborted(decoder) == aborted_before:  # ended by the abort, not by its 300 letters
        assert time.monotonic() < deadline
        time.sleep(0.1)
