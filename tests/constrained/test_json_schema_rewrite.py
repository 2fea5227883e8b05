"""The rewrite that keeps raw control characters out of length-bounded JSON strings (mlc-ai/xgrammar#800)."""

from __future__ import annotations

import json
import re

import pytest

from pdserve.constrained.json_schema import strict_json_schema


def test_length_bounded_strings_get_a_control_free_pattern_everywhere():
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 5},
        "b": {"type": "array", "items": {"type": "string", "minLength": 2}},
        "c": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 3}, {"type": "null"}]}}}
    props = json.loads(strict_json_schema(json.dumps(schema)))["properties"]
    assert props["a"] == {"type": "string", "pattern": r'^[^\x00-\x1f"\\]{0,5}$'}
    assert props["b"]["items"] == {"type": "string", "pattern": r'^[^\x00-\x1f"\\]{2,}$'}
    assert props["c"]["anyOf"][0] == {"type": "string", "pattern": r'^[^\x00-\x1f"\\]{1,3}$'}


def test_strings_xgrammar_already_bounds_are_left_alone():
    for node in ({"type": "string"}, {"type": "string", "maxLength": 3, "pattern": "^a+$"},
                 {"type": "string", "maxLength": 30, "format": "date"}, {"type": "string", "enum": ["x"]}):
        assert json.loads(strict_json_schema(json.dumps(node))) == node


@pytest.mark.parametrize("low, high", [(0, 128), (0, 200), (150, 300), (129, 129), (200, None)])
def test_bounds_past_xgrammars_repeat_limit_compile_and_hold(tiny_model, low, high):
    """xgrammar 0.2.8 refuses `{m,n}` counts above 128; the rewrite splits them, and the lengths still hold."""
    xgrammar = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    node = {"type": "string", "minLength": low} | ({} if high is None else {"maxLength": high})
    pattern = json.loads(strict_json_schema(json.dumps(node)))["pattern"]
    assert all(int(count) <= 128 for count in re.findall(r"\d+", pattern.split("]", 1)[1]))
    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(tiny_model))
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(strict_json_schema(json.dumps(node)))
    longest = (high if high is not None else low + 300)
    for length in {low, longest, max(low - 1, 0), longest + 1}:
        matcher = xgrammar.GrammarMatcher(compiled)
        fits = low <= length and (high is None or length <= high)
        assert matcher.accept_string(f'"{"a" * length}"') == fits, length


@pytest.fixture(scope="module")
def tiny_compiler(tiny_model):
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from pdserve.constrained.compiler import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    compiler = GrammarCompiler(lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id], any_whitespace=False)
    yield compiler
    compiler.close()


def accepts(compiler, schema: dict, text: str) -> bool:
    import xgrammar

    from pdserve.constrained.compiler import GrammarSpec

    matcher = xgrammar.GrammarMatcher(compiler.compile(GrammarSpec("json_schema", json.dumps(schema))))
    return matcher.accept_string(text)


@pytest.mark.parametrize("low, high", [(0, 5), (0, 128), (0, 200), (150, 300), (129, 129), (200, None)])
def test_length_bounded_strings_hold_their_lengths_through_the_server_compiler(tiny_compiler, low, high):
    node = {"type": "string", "minLength": low} | ({} if high is None else {"maxLength": high})
    longest = high if high is not None else low + 300
    for length in {low, longest, max(low - 1, 0), longest + 1}:
        fits = low <= length and (high is None or length <= high)
        assert accepts(tiny_compiler, node, f'"{"a" * length}"') == fits, length


@pytest.mark.parametrize("char", ["\x00", "\x01", "\t", "\x1f", "\n", "\r", '"', "\\"])
def test_length_bounded_strings_refuse_raw_control_characters_quotes_and_backslashes(tiny_compiler, char):
    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 40}},
              "required": ["name"]}
    assert accepts(tiny_compiler, schema, '{"name": "ab"}')
    assert not accepts(tiny_compiler, schema, '{"name": "a' + char + 'b"}')


def test_every_length_bounded_string_rule_is_narrowed():
    """xgrammar's own grammar of the schema, each length-bounded string's character rule without control
    characters; no other rule changed; a schema without one keeps xgrammar's schema compile (None)."""
    xgrammar = pytest.importorskip("xgrammar")
    from pdserve.constrained import json_schema

    schema = {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 5},
        "b": {"type": "array", "items": {"type": "string", "minLength": 2}},
        "c": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 3}, {"type": "null"}]},
        "d": {"type": "string"}}}
    text = json.dumps(schema)
    native = str(xgrammar.Grammar.from_json_schema(text, any_whitespace=False)).splitlines()
    strict = json_schema.strict_json_grammar(xgrammar, text, any_whitespace=False).splitlines()
    changed = [(old, new) for old, new in zip(native, strict, strict=True) if old != new]
    assert len(changed) == 3
    assert all(new.endswith(r"_characters ::= (([^\0-\x1f\"\\]))") for _, new in changed)
    assert json_schema.strict_json_grammar(xgrammar, json.dumps({"type": "string"}), any_whitespace=False) is None
