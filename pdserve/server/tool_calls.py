"""OpenAI structured output on the chat and completions routes: `response_format` and `tools` + `tool_choice`
turned into a JSON-schema constraint, and tool calls parsed back out of the output.

- `response_format`: `json_object` is a top-level object; `json_schema` is its `json_schema.schema`.
- `tool_choice: "required"`: the output is constrained to a JSON array of `{"name": ..., "arguments": {...}}`, one
  entry per call (exactly one when `parallel_tool_calls` is false), each name one of the tools and its arguments
  that tool's `parameters` schema.
- a named function: the output is constrained to that function's `parameters` schema: the arguments of one call.
- `"auto"`: the output is free; tool calls are parsed where the model wrote them in its family's convention
  (`--tool-call-parser`): `qwen25` (Qwen 2.5/3, Hermes) `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, the text outside them the message's content; `llama3` (Llama 3.1+) an output that is nothing but JSON
  calls `{"name": ..., "parameters": {...}}` (after an optional `<|python_tag|>`, several separated by `;`).
  `"none"`: tools are neither offered to the chat template nor parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
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


def parse_tool_calls(text: str, choice: ToolChoice, parser: str = "qwen25") -> tuple[str | None, list[dict]]:
    """(the message's content, its OpenAI tool_calls) from the output `text`; no calls where none parse."""
    if choice.mode == "none":
        return text, []
    if choice.mode == "auto":
        return _llama3_calls(text) if parser == "llama3" else _qwen25_calls(text)
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text, []  # cut off by max_tokens or a stop string: no call, the text as it is
    if choice.mode == "named":
        return None, [_openai_call(choice.name, value)]
    return None, [_openai_call(item["name"], item["arguments"]) for item in value]


def _qwen25_calls(text: str) -> tuple[str | None, list[dict]]:
    calls = [call for block in TOOL_CALL_BLOCK.findall(text) for call in _calls_in(block)]
    return (TOOL_CALL_BLOCK.sub("", text).strip() or None, calls) if calls else (text, [])


def _llama3_calls(text: str) -> tuple[str | None, list[dict]]:
    """Calls only where the whole output is JSON calls (else it is content, as Llama 3 answers in prose)."""
    rest, values, decoder = text.strip().removeprefix(LLAMA3_PYTHON_TAG).strip(), [], json.JSONDecoder()
    while rest:
        try:
            value, end = decoder.raw_decode(rest)
        except json.JSONDecodeError:
            return text, []
        values.append(value)
        rest = rest[end:].strip().removeprefix(";").strip()
    calls = [_call_of(value) for value in values]
    return (None, calls) if calls and all(calls) else (text, [])


def _calls_in(block: str) -> list[dict]:
    try:
        call = _call_of(json.loads(block))
    except json.JSONDecodeError:
        return []
    return [call] if call else []


def _call_of(value: Any) -> dict | None:
    """The OpenAI call of a parsed `{"name", "arguments" or "parameters"}` object, None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return _openai_call(value["name"], value.get("arguments", value.get("parameters", {})))


def _openai_call(name: str, arguments: Any) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _function(tool: dict) -> dict:
    return tool.get("function") or {}


def _parameters(tool: dict) -> dict:
    return _function(tool).get("parameters") or {"type": "object"}
