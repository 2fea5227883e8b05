"""Hand-written hostile bodies against every generation route of every process: each answer is a JSON 4xx (or a
deliberate 502/503/504), never a 500, a non-JSON error or a hang; the router relays a server's 4xx at once."""

from __future__ import annotations

import json

import pytest
from fuzz_util import GENERATION_ROUTES, problem, send

TARGETS = ("colocated", "prefill", "decode", "router")
DEPTH = 100_000
HOSTILE_BODIES = {
    "lone surrogate in text": b'{"text": "a\\ud800b", "prompt": "a\\udfffb", "model": "m", '
                              b'"messages": [{"role": "user", "content": "\\ud800"}]}',
    "lone surrogate in stop": b'{"text": "hi", "prompt": "hi", "stop": "\\ud800", "model": "m"}',
    "lone surrogate in a key": b'{"\\udc00": 1}',
    "deeply nested array": b'{"text": ' + b"[" * DEPTH + b"]" * DEPTH + b"}",
    "deeply nested object": b'{"text": "a", "x": ' + b'{"a": ' * DEPTH + b"1" + b"}" * DEPTH + b"}",
    "invalid UTF-8": b'{"text": "\xff\xfe\xc3", "prompt": "\xc0\xaf"}',
    "truncated": b'{"text": "hel',
    "empty": b"",
    "an array": b"[1, 2]",
    "null": b"null",
    "NaN": b'{"text": "hi", "prompt": "hi", "temperature": NaN}',
    "Infinity": b'{"text": "hi", "prompt": "hi", "top_p": -Infinity}',
    "5000-digit integer": b'{"text": "hi", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
    "float top_k": b'{"text": "hi", "prompt": "hi", "top_k": 1e30}',
    "huge top_k": b'{"text": "hi", "prompt": "hi", "top_k": 100000000000000000000000}',
    "wrong types": b'{"text": 5, "prompt": {"a": 1}, "messages": "hi", "model": 3, "n": "2"}',
    "UTF-16 body": json.dumps({"text": "hi", "prompt": "hi"}).encode("utf-16"),
}
CONTENT_TYPES = ("text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1",
                 "application/json; charset=no-such-charset", None)


@pytest.mark.parametrize("target", TARGETS)
def test_hostile_bodies_get_json_4xx(targets, target):
    url = targets.by_name(target).url
    found = {}
    for route in GENERATION_ROUTES:
        for name, body in HOSTILE_BODIES.items():
            answer = send(url, "POST", route, body)
            if (issue := problem(answer)) or not 400 <= answer.status < 500:
                found[f"{route} {name}"] = issue or f"HTTP {answer.status}"
    assert not found, found
    targets.by_name(target).check_alive()


@pytest.mark.parametrize("target", TARGETS)
def test_content_types_and_unknown_routes_get_json_errors(targets, target):
    url = targets.by_name(target).url
    body = json.dumps({"text": "hi", "prompt": "hi", "model": "nope", "max_new_tokens": 1}).encode()
    answers = {f"{route} {ctype}": send(url, "POST", route, body, ctype)
               for route in GENERATION_ROUTES for ctype in CONTENT_TYPES}
    answers |= {f"{method} {path}": send(url, method, path, b"\xff")
                for path in ("/no/such/route", "/get_model_info", "/v1/models")
                for method in ("PUT", "DELETE", "PATCH")}
    found = {what: issue for what, answer in answers.items() if (issue := problem(answer))}
    assert not found, found


def test_router_relays_a_server_4xx_at_once(targets):
    """A client's bad request is refused by the instance with a 4xx; the router passes it on as is instead of
    retrying it as if the instance had failed (which ended in a 502 after 4 attempts)."""
    body = b'{"text": "a\\ud800b", "sampling_params": {"max_new_tokens": 1}}'
    direct = send(targets.decode.url, "POST", "/generate", body)
    routed = send(targets.router.url, "POST", "/generate", body)
    assert direct.status == routed.status == 400, (direct, routed)
    assert json.loads(routed.body)["error"]["message"] == json.loads(direct.body)["error"]["message"]
