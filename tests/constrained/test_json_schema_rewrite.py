"""The rewrite that keeps raw control characters out of length-bounded JSON strings (mlc-ai/xgrammar#800)."""

from __future__ import annotations

import json

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
