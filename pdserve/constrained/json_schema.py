"""Makes what xgrammar 0.2.8 generates from a JSON schema strict JSON.

Stock xgrammar 0.2.8 lets a string with `minLength`/`maxLength` hold raw control characters (mlc-ai/xgrammar#800),
which `json.loads` refuses: it writes such a string as a repetition `X_characters{m, n}` of a rule that excludes
only quotes, backslashes, CR and LF. `strict_json_grammar` takes xgrammar's own grammar of the schema and narrows
each of those rules to exclude every control character. Keeping xgrammar's repetition of one character rule keeps
its token masks shared across bounds: the states of `{0, 32}` are those of `{0, 128}` at fewer characters left, so
once one bound compiled, every smaller bound compiles in milliseconds (a regex `[...]{0,32}` per bound did not share
them: each new bound paid for all its states again).

`strict_json_schema` is the fallback where xgrammar writes those rules otherwise (another xgrammar version): each
length-bounded string becomes a control-character-free `pattern` over the same lengths. xgrammar 0.2.8 refuses a
regex repetition count above 128, so longer bounds are written there as consecutive repetitions.
"""

from __future__ import annotations

import json
from typing import Any

_LENGTH_KEYS = ("minLength", "maxLength")
_KEEPS_OWN_GRAMMAR = ("pattern", "format", "enum", "const")  # a string schema xgrammar already bounds safely
_SAFE_CHAR = r'[^\x00-\x1f"\\]'
_MAX_REPEAT = 128  # the largest count xgrammar 0.2.8 compiles in `{m,n}`
_CHARACTERS_RULE = "_characters"  # how xgrammar 0.2.8 names a length-bounded string's character rule
_LOOSE_CHARACTERS = r'(([^\"\\\r\n]))'  # that rule's body as xgrammar writes it
_STRICT_CHARACTERS = r'(([^\0-\x1f\"\\]))'  # the same without any control character


def strict_json_grammar(xgrammar: Any, schema_text: str, any_whitespace: bool) -> str | None:
    """The EBNF xgrammar generates from the schema with every length-bounded string's character rule strict; None
    where the schema has no length-bounded string (xgrammar's own schema compile is strict JSON then) or where none
    of xgrammar's rules has the expected form (the caller falls back to `strict_json_schema`)."""
    if not _has_length_bounded_string(json.loads(schema_text)):
        return None
    grammar = str(xgrammar.Grammar.from_json_schema(schema_text, any_whitespace=any_whitespace))
    lines, narrowed = [], 0
    for line in grammar.splitlines():
        name, _, body = line.partition(" ::= ")
        if name.endswith(_CHARACTERS_RULE) and body == _LOOSE_CHARACTERS:
            line, narrowed = f"{name} ::= {_STRICT_CHARACTERS}", narrowed + 1
        lines.append(line)
    return "\n".join(lines) if narrowed else None


def strict_json_schema(schema_text: str) -> str:
    """`schema_text` with every length-bounded string given a control-character-free pattern instead."""
    return json.dumps(_rewrite(json.loads(schema_text)))


def _has_length_bounded_string(node: Any) -> bool:
    if isinstance(node, list):
        return any(_has_length_bounded_string(item) for item in node)
    if not isinstance(node, dict):
        return False
    return _is_length_bounded_string(node) or any(_has_length_bounded_string(value) for value in node.values())


def _rewrite(node: Any) -> Any:
    if isinstance(node, list):
        return [_rewrite(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _rewrite(value) for key, value in node.items()}
    if _is_length_bounded_string(out):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^{_repeat(_SAFE_CHAR, low, high if high != '' else None)}$"
    return out


def _repeat(atom: str, low: int, high: int | None) -> str:
    """`atom{low,high}` (high None: unbounded) as repetitions of at most _MAX_REPEAT each."""
    parts = []
    while low > _MAX_REPEAT:
        parts.append(f"{atom}{{{_MAX_REPEAT}}}")
        low -= _MAX_REPEAT
        high = None if high is None else high - _MAX_REPEAT
    if high is None:
        return "".join(parts) + f"{atom}{{{low},}}"
    first = min(high, _MAX_REPEAT)
    parts.append(f"{atom}{{{low},{first}}}")
    for left in range(high - first, 0, -_MAX_REPEAT):
        parts.append(f"{atom}{{0,{min(left, _MAX_REPEAT)}}}")
    return "".join(parts)


def _is_length_bounded_string(node: dict) -> bool:
    return node.get("type") == "string" and any(k in node for k in _LENGTH_KEYS) \
        and not any(k in node for k in _KEEPS_OWN_GRAMMAR)
