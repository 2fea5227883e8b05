"""The schemas that enforce tool_choice and the choice's checks, without a server (the parser of the answers:
test_tool_call_parser.py)."""

from __future__ import annotations

import json

import pytest

from pdserve.server.tool_calls import (ToolChoice, pick_tool_call_parser, response_format_schema, tool_call_schema,
                                       tool_choice_of)

TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


def test_the_parser_follows_the_flag_else_the_chat_template():
    assert pick_tool_call_parser("qwen25", "... <|python_tag|> ...") == "qwen25"
    assert pick_tool_call_parser(None, "{{ '<|python_tag|>' }}") == "llama3"
    assert pick_tool_call_parser(None, "<|im_start|>") == "qwen25" and pick_tool_call_parser(None, None) == "qwen25"


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
