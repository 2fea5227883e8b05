"""OpenAI structured output on the chat and completions routes: `response_format` and `tools` + `tool_choice`
turned into a JSON-schema constraint, and tool calls parsed back out of the output.

- `response_format`: `json_object` is a top-level object; `json_schema` is its `json_schema.schema`.
- `tool_choice: "required"`: the output is constrained to a JSON array of `{"name": ..., "arguments": {...}}`, one
  entry per call (exactly one when `parallel_tool_calls` is false), each name one of the tools and its arguments
  that tool's `parameters` schema.
- a named function: the output is constrained to that function's `parameters` schema: the arguments of one call.
- `"auto"`: the output is free; tool calls are read where the model wrote them in its family's convention
  (`--tool-call-parser`, see `tool_call_parser.py`, which reads the calls of every mode back out of the output).
  `"none"`: tools are neither offered to the chat template nor parsed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

LLAMA3_PYTHON_TAG = "<|python_tag|>"
ANY_OBJECT = '{"type": "object"}'


def pick_tool_call_parser(configured: str | None, chat_template: str | None) -> str:
    """`--tool-call-parser`, else llama3 for a chat template that uses Llama 3's python tag, else qwen25."""
    if configured is not None:
        return configured
    return "llama3" if chat_template and LLAMA3_PYTHON_TAG in chat_template else "qwen25"


@dataclass(slots=True, frozen=True)
class ToolChoice:
    """What the request asked of its tools: mode is none, auto, required or named (then `name` is the function)."""

    mode: str
    name: str | None = None


def response_format_schema(response_format: dict[str, Any] | None) -> str | None:
    """The JSON schema text `response_format` asks for, None for free text; ValueError for a bad one."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs json_schema.schema, a JSON schema object")
        return json.dumps(schema)
    raise ValueError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)")


def tool_choice_of(tool_choice: str | dict | None, tools: list[dict]) -> ToolChoice:
    """The request's tool choice, checked against its tools (OpenAI's default: auto with tools, else none)."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice must be none, auto, required or a function, got {tool_choice!r}")
        if tool_choice != "none" and not tools:
            raise ValueError(f"tool_choice {tool_choice!r} needs tools")
        return ToolChoice(tool_choice)
    name = (tool_choice.get("function") or {}).get("name")
    if name not in {_function(t)["name"] for t in tools}:
        raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
    return ToolChoice("named", name)


def tool_call_schema(choice: ToolChoice, tools: list[dict], parallel: bool) -> str | None:
    """The JSON schema text that enforces `choice` (None for none and auto)."""
    if choice.mode == "named":
        return json.dumps(_parameters(next(t for t in tools if _function(t)["name"] == choice.name)))
    if choice.mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": _function(t)["name"]}, "arguments": _parameters(t)},
              "required": ["name", "arguments"]} for t in tools]
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return json.dumps(array)


def _function(tool: dict) -> dict:
    return tool.get("function") or {}


def _parameters(tool: dict) -> dict:
    return _function(tool).get("parameters") or {"type": "object"}
