"""A request body's validation errors in the client's terms: where (`messages[0].role`) and what is wrong, without
pydantic's internals (the union members it tried, `list[SamplingFields]`, ...).

Pydantic reports a value that fits no member of a union once per member, each under a location step naming the
member. Here a member whose errors lie deeper than the union's own field, or only break a bound of the right type
(a string too long), fitted the value's shape: only its errors count (those of the member with the fewest, when several fitted). Where no member fitted, the field gets
one line naming the shapes it may take.
"""

from __future__ import annotations

import re
from typing import Any

MAX_PROBLEMS = 5
_NOUNS = {"str": ("a string", "strings"), "int": ("an integer", "integers"), "float": ("a number", "numbers"),
          "bool": ("true or false", "booleans")}
_LIST = re.compile(r"list\[(.+)\]")


def validation_problems(errors: list[dict[str, Any]]) -> list[str]:
    """One line per problem, `where: what`, at most MAX_PROBLEMS."""
    return _problems([(tuple(e["loc"]), e) for e in errors], ())[:MAX_PROBLEMS]


def _is_member(step: Any) -> bool:
    """A location step that names a union member (`str`, `list[int]`, `SamplingFields`), not a field or index."""
    return isinstance(step, str) and (step in _NOUNS or not re.fullmatch(r"[a-z_][a-z0-9_]*", step))


def _problems(errors: list[tuple[tuple, dict]], above: tuple) -> list[str]:
    """`errors` as (location below `above`, error), in pydantic's order; a union's members are settled first."""
    unions: dict[tuple, list[tuple[tuple, dict]]] = {}
    lines: list[str | tuple] = []
    for loc, error in errors:
        if not any(_is_member(step) for step in loc):
            lines.append(f"{_where(above + loc)}: {_what(error)}")
            continue
        fork = _fork(loc)
        if fork not in unions:
            lines.append(fork)  # its place, filled in below
        unions.setdefault(fork, []).append((loc, error))
    return [text for line in lines for text in
            ([line] if isinstance(line, str) else _union_problems(unions[line], above + line, len(line)))]


def _fork(loc: tuple) -> tuple:
    """The location of the field whose union the first member step belongs to."""
    return loc[:next(i for i, step in enumerate(loc) if _is_member(step))]


def _union_problems(group: list[tuple[tuple, dict]], field: tuple, member_step: int) -> list[str]:
    """The errors of one union at `field`, each location's step `member_step` naming the member."""
    members: dict[str, list[tuple[tuple, dict]]] = {}
    for loc, error in group:
        members.setdefault(loc[member_step], []).append((loc[member_step + 1:], error))
    fitted = {name: errs for name, errs in members.items()
              if all(any(not _is_member(step) for step in loc) or not _wrong_shape(e) for loc, e in errs)}
    if fitted:
        best = min(fitted.values(), key=len)
        return _problems(best, field)
    shapes = [_shape(name, errs[0][1]) for name, errs in members.items()]
    return [f"{_where(field)}: must be {_either(shapes)}"]


def _wrong_shape(error: dict) -> bool:
    """The value is not of the member's type (a string for a list, ...), as opposed to a value of the right type that
    breaks a bound (a string too long), which means the member fitted."""
    kind = error["type"]
    return kind.endswith(("_type", "_parsing")) or kind in ("literal_error", "is_instance_of", "union_tag_invalid")


def _shape(member: str, error: dict) -> str:
    if error["type"] == "literal_error":
        return "one of " + error["ctx"]["expected"]
    return _noun(member)[0]


def _noun(member: str) -> tuple[str, str]:
    """How to name a value of `member`, one and several."""
    inner = _LIST.fullmatch(member)
    if inner:
        several = _noun(inner.group(1))[1]
        return f"a list of {several}", f"lists of {several}"
    base = member.removeprefix("constrained-")  # a str or int with bounds
    if base in _NOUNS:
        return _NOUNS[base]
    return "an object", "objects"  # a model or a dict


def _either(shapes: list[str]) -> str:
    shapes = list(dict.fromkeys(shapes))
    return shapes[0] if len(shapes) == 1 else ", ".join(shapes[:-1]) + " or " + shapes[-1]


def _where(loc: tuple) -> str:
    text = "".join(f"[{step}]" if isinstance(step, int) else f".{step}" for step in loc).lstrip(".")
    return text or "the body"


def _what(error: dict) -> str:
    kind = error["type"]
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        return "is not a field of this request"
    if kind == "too_short" and error.get("ctx", {}).get("min_length") == 1:
        return "must not be empty"
    if kind in ("model_type", "dict_type"):
        return "should be a JSON object"
    return re.sub(r"^Input should", "should", error["msg"])
