"""The incremental tool-call parser: what it reads out of whole answers, and that any chunking of a text streams
pieces that add up to the one-shot parse (the blocking answer) without ever taking text back."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.server.tool_call_parser import Arguments, Content, assemble, parse_tool_calls, tool_call_stream
from pdserve.server.tool_calls import ToolChoice

AUTO, REQUIRED, NAMED = ToolChoice("auto"), ToolChoice("required"), ToolChoice("named", "add")


def calls_of(text: str, choice: ToolChoice = AUTO, parser: str = "qwen25") -> tuple[str | None, list[tuple]]:
    content, calls = parse_tool_calls(text, choice, parser)
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_qwen_blocks_are_calls_and_the_rest_content_without_the_whitespace_around_calls():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n' \
           '<tool_call>{"arguments": {"a": "}\\"{"}, "name": "add"}</tool_call> Done.'
    assert calls_of(text) == ("Let me add.Done.", [("add", '{"a": 1}'), ("add", '{"a": "}\\"{"}')])


@pytest.mark.parametrize("text", ["no call here", "<tool_call>{not json}</tool_call>", "<tool_call>[1]</tool_call>",
                                  '<tool_call>{"name": 5}</tool_call>', '<tool_call>{"a": 1}</tool_call>',
                                  "ends in a partial tag <tool_c", "  "])
def test_qwen_text_without_a_call_is_content_as_written(text):
    assert calls_of(text) == (text, [])


def test_a_call_stands_once_its_name_is_read_and_keeps_what_came_of_its_arguments():
    assert calls_of('<tool_call>{"name": "add"') == (None, [("add", "")])
    assert calls_of('<tool_call>{"name": "add", "arguments": {"a": 12') == (None, [("add", '{"a": 12')])
    assert calls_of('<tool_call>{"name": "add"}</tool_call>') == (None, [("add", "{}")])


def test_llama3_calls_and_prose():
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": 2}}'
    assert calls_of(text, parser="llama3") == (None, [("add", '{"a": 1}'), ("add", '{"a": 2}')])
    for prose in ["The answer is 3.", '{"a": 1}', "[1, 2]", "A {\"name\": \"add\"}"]:
        assert calls_of(prose, parser="llama3") == (prose, [])
    assert calls_of('{"name": "add"} and then prose', parser="llama3") == ("and then prose", [("add", "{}")])


def test_required_and_named_outputs():
    text = '[{"name": "add", "arguments": {"a": 3}}, {"name": "sub", "arguments": {"b": [1, 2]}}]'
    assert calls_of(text, REQUIRED) == (None, [("add", '{"a": 3}'), ("sub", '{"b": [1, 2]}')])
    assert calls_of("[", REQUIRED) == ("", [])
    assert calls_of(' {"a": 4}\n', NAMED) == (None, [("add", '{"a": 4}')])
    assert calls_of('{"a": ', NAMED) == (None, [("add", '{"a":')])  # cut off by max_tokens


def test_tool_choice_none_keeps_the_text_whole():
    text = '<tool_call>{"name": "add"}</tool_call>'
    assert calls_of(text, ToolChoice("none")) == (text, [])


def test_the_stream_shapes_calls_as_openai_does():
    stream = tool_call_stream(AUTO, "qwen25")
    pieces = stream.feed("Hi <tool_call>") + stream.feed('{"name": "add", "argu') + stream.feed('ments": {"a": 1') \
        + stream.feed("}}</tool_call>") + stream.finish()
    assert pieces[0] == Content("Hi") and pieces[1].name == "add" and pieces[1].index == 0
    assert pieces[2:] == [Arguments(0, '{"a": 1'), Arguments(0, "}")] and stream.num_calls == 1


def test_text_that_may_start_a_tag_is_held_until_decided():
    stream = tool_call_stream(AUTO, "qwen25")
    assert stream.feed("Hi <tool") == [Content("Hi")]
    assert stream.feed("box> x") == [Content(" <toolbox> x")]


# --- any chunking streams the one-shot parse ---------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-999, 999) | st.text("ab{}[]\"\\:, <>/\n", max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text("xyz\"{", max_size=3), inner, max_size=3),
    max_leaves=6)
SEPARATORS = st.sampled_from([(", ", ": "), (",", ":")])


@st.composite
def call_objects(draw, arguments_key: str = "arguments") -> str:
    entries = [("name", draw(st.sampled_from(["add", "get_weather", "x\"y"])))]
    if draw(st.booleans()):
        entries.append((arguments_key, draw(st.dictionaries(st.text("ab", max_size=2), JSON_VALUES, max_size=3))))
    if draw(st.booleans()):
        entries.reverse()
    return json.dumps(dict(entries), separators=draw(SEPARATORS))


TEXT_BITS = st.sampled_from(["Hi", " ", "\n", "<", "<tool", "<tool_call>", "</tool_call>", "{", "}", "\"", ";",
                             "<|python_tag|>", "[", "]", ",", "name", ":", "x"])
QWEN_TEXTS = st.lists(TEXT_BITS | call_objects().map(lambda call: f"<tool_call>\n{call}\n</tool_call>"),
                      max_size=8).map("".join)
LLAMA3_TEXTS = st.lists(TEXT_BITS | call_objects("parameters"), max_size=6).map("".join)
REQUIRED_TEXTS = st.lists(call_objects(), min_size=1, max_size=3).map(lambda calls: "[" + ", ".join(calls) + "]")
NAMED_TEXTS = st.dictionaries(st.text("ab", max_size=2), JSON_VALUES, max_size=3).map(json.dumps)
CASES = [(AUTO, "qwen25", QWEN_TEXTS), (AUTO, "llama3", LLAMA3_TEXTS), (REQUIRED, "qwen25", REQUIRED_TEXTS),
         (NAMED, "qwen25", NAMED_TEXTS)]


@pytest.mark.parametrize("choice, parser, texts", CASES, ids=["qwen25", "llama3", "required", "named"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_chunking_streams_the_one_shot_parse(choice, parser, texts, data):
    text = data.draw(texts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stream = tool_call_stream(choice, parser)
    streamed = [piece for chunk in chunks for piece in stream.feed(chunk)] + stream.finish()
    one_shot = tool_call_stream(choice, parser)
    whole = one_shot.feed(text) + one_shot.finish()
    content, calls = assemble(streamed)
    expected_content, expected_calls = assemble(whole)
    assert content == expected_content
    assert [c["function"] for c in calls] == [c["function"] for c in expected_calls]
    assert stream.num_calls == len(calls)


@settings(max_examples=100, deadline=None)
@given(text=REQUIRED_TEXTS)
def test_grammar_shaped_calls_keep_their_arguments_as_written(text):
    _, calls = parse_tool_calls(text, REQUIRED)
    expected = [(item["name"], item.get("arguments", {})) for item in json.loads(text)]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected
    for call, item in zip(calls, json.loads(text)):  # the model's own text, or {} where it wrote no arguments
        assert call["function"]["arguments"] in text if "arguments" in item else call["function"]["arguments"] == "{}"
