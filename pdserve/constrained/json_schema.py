"""Rewrites a JSON schema so that what xgrammar 0.2.8 generates from it is strict JSON.

Stock xgrammar 0.2.8 lets a string with `minLength`/`maxLength` hold raw control characters (mlc-ai/xgrammar#800),
which `json.loads` refuses. Such a string becomes a `pattern` over the same lengths that excludes control
characters (and, as xgrammar applies patterns to unescaped characters only, quotes and backslashes). xgrammar
0.2.8 refuses a regex repetition count above 128, so longer bounds are written as consecutive repetitions.
"""

from __future__ import annotations

import json
from typing import Any

_LENGTH_KEYS = ("minLength", "maxLength")
_KEEPS_OWN_GRAMMAR = ("pattern", "format", "enum", "const")  # a string schema xgrammar already bounds safely
_SAFE_CHAR = r'[^\x00-\x1f"\\]'
_MAX_REPEAT = 128  # the largest count xgrammar 0.2.8 compiles in `{m,n}`


def strict_json_schema(schema_text: str) -> str:
    """`schema_text` with every length-bounded string given a control-character-free pattern instead."""
    return json.dumps(_rewrite(json.loads(schema_text)))


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
