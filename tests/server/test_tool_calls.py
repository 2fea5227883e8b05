"""The tool-call parser and the schemas that enforce tool_choice, without a server."""

from __future__ import annotations

import json

import pytest

from pdserve.server.tool_calls import (ToolChoice, parse_tool_calls, pick_tool_call_parser, response_format_schema,
                                       tool_call_schema, tool_choice_of)

TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


def names_and_arguments(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_auto_parses_qwen_hermes_blocks_and_keeps_the_rest_as_content():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' \
           '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    content, calls = parse_tool_calls(text, ToolChoice("auto"))
    assert content == "Let me add." and names_and_arguments(calls) == [("add", {"a": 1}), ("add", {"a": 2})]
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("text", ["no call here", "<tool_call>{not json}</tool_call>", "<tool_call>[1]</tool_call>",
                                  '<tool_call>{"name": "add"'])
def test_auto_without_a_parseable_call_is_plain_content(text):
    assert parse_tool_calls(text, ToolChoice("auto")) == (text, [])


def test_auto_with_llama3_parses_json_calls():
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": 2}}'
    content, calls = parse_tool_calls(text, ToolChoice("auto"), "llama3")
    assert content is None and names_and_arguments(calls) == [("add", {"a": 1}), ("add", {"a": 2})]


@pytest.mark.parametrize("text", ["The answer is 3.", '{"name": "add"} and then prose', '{"a": 1}', "[1, 2]"])
def test_auto_with_llama3_leaves_prose_as_content(text):
    assert parse_tool_calls(text, ToolChoice("auto"), "llama3") == (text, [])


def test_the_parser_follows_the_flag_else_the_chat_template():
    assert pick_tool_call_parser("qwen25", "... <|python_tag|> ...") == "qwen25"
    assert pick_tool_call_parser(None, "{{ '<|python_tag|>' }}") == "llama3"
    assert pick_tool_call_parser(None, "<|im_start|>") == "qwen25" and pick_tool_call_parser(None, None) == "qwen25"


def test_required_and_named_outputs_parse_into_calls():
    required = parse_tool_calls('[{"name": "add", "arguments": {"a": 3}}]', ToolChoice("required"))
    named = parse_tool_calls('{"a": 4}', ToolChoice("named", "add"))
    assert required[0] is None and names_and_arguments(required[1]) == [("add", {"a": 3})]
    assert named[0] is None and names_and_arguments(named[1]) == [("add", {"a": 4})]
    assert parse_tool_calls('{"a": ', ToolChoice("named", "add")) == ('{"a": ', [])  # cut off: no call


def test_schemas_that_enforce_tool_choice():
    required = json.loads(tool_call_schema(ToolChoice("required"), [TOOL], parallel=False))
    assert required["maxItems"] == 1 and required["items"]["anyOf"][0]["properties"]["name"] == {"const": "add"}
    assert "maxItems" not in json.loads(tool_call_schema(ToolChoice("required"), [TOOL], parallel=True))
    assert json.loads(tool_call_schema(ToolChoice("named", "add"), [TOOL], True)) == TOOL["function"]["parameters"]
    assert tool_call_schema(ToolChoice("auto"), [TOOL], True) is None


def test_tool_choice_defaults_and_checks():
    assert tool_choice_of(None, [TOOL]) == ToolChoice("auto") and tool_choice_of(None, []) == ToolChoice("none")
    assert tool_choice_of({"type": "function", "function": {"name": "add"}}, [TOOL]) == ToolChoice("named", "add")
    with pytest.raises(ValueError, match="needs tools"):
        tool_choice_of("required", [])


def test_response_format_schemas():
    assert response_format_schema(None) is None and response_format_schema({"type": "text"}) is None
    assert json.loads(response_format_schema({"type": "json_object"})) == {"type": "object"}
    schema = {"type": "object", "properties": {}}
    assert json.loads(response_format_schema({"type": "json_schema", "json_schema": {"schema": schema}})) == schema
    with pytest.raises(ValueError, match="not supported"):
        response_format_schema({"type": "regex"})
