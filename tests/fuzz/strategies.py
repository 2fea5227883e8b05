"""Hypothesis strategies for the fuzz suite: request bodies drawn from the schema models' JSON schemas
(hypothesis-jsonschema), kept cheap to serve, and hostile variants of them spliced at the byte level."""

from __future__ import annotations

import json
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from pydantic import BaseModel

from pdserve.server.schemas import AbortRequestInput

# Generated lengths above this are cut down (modulo), so that an accepted request costs a few decode steps;
# values from this bound up stay as drawn and are refused.
CHEAP_TOKENS = 4
REFUSED_FROM = 10**6
TOKEN_LIMITS = ("max_new_tokens", "max_tokens", "max_completion_tokens", "min_new_tokens", "min_tokens")
# The router sets these; a server given a random host would spend its bootstrap timeout resolving it.
ROUTER_ONLY = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
HOSTILE_VALUES = (
    b"NaN", b"-Infinity", b"1e400", b"9" * 400, b"-" + b"9" * 30, b'"\\ud800"', b'"\\udfff\\ud800"', b"[[[[[[]]]]]]",
    b"{}", b"[]", b"null", b"true", b"-1", b"0", b"1.5", b'""', b'"' + b"x" * 100_000 + b'"', b"[" + b"7, " * 5000 + b"7]",
)


def schema_bodies(model: type[BaseModel], served_model: str | None) -> st.SearchStrategy[dict]:
    """Objects that satisfy `model`'s JSON schema; for OpenAI models mostly naming the served model."""
    bodies = from_schema(model.model_json_schema()).filter(lambda b: isinstance(b, dict)).map(cheap)
    if served_model is None:
        return bodies
    return st.tuples(bodies, st.booleans()).map(lambda pair: {**pair[0], "model": served_model} if pair[1] else pair[0])


def cheap(body: dict) -> dict:
    """The body with its token limits cut to a few tokens (a limit absent gets one) and no bootstrap fields."""
    body = {k: v for k, v in body.items() if k not in ROUTER_ONLY}
    if not any(k in body for k in TOKEN_LIMITS[:3]):
        body["max_tokens" if "messages" in body or "prompt" in body else "max_new_tokens"] = CHEAP_TOKENS
    nested = body.get("sampling_params")
    for fields in [body, *(nested if isinstance(nested, list) else [nested])]:
        if isinstance(fields, dict):
            for key in TOKEN_LIMITS:
                value = fields.get(key)
                if isinstance(value, int) and CHEAP_TOKENS < value < REFUSED_FROM:
                    fields[key] = value % (CHEAP_TOKENS + 1)
    return body


def plausible_bodies(route: str, served_model: str) -> st.SearchStrategy[dict]:
    """Bodies a real client would send (a prompt, a few sane sampling fields), so that the fuzz also reaches the
    accepting paths: generation, streaming, logprobs, batches, stops."""
    prompt = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)
    sampling = st.fixed_dictionaries({}, optional={
        "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 50),
        "min_p": st.floats(0, 1), "stop": st.lists(st.text(max_size=4), max_size=2),
        "stop_token_ids": st.lists(st.integers(0, 300), max_size=3), "ignore_eos": st.booleans(),
        "repetition_penalty": st.floats(0.5, 2), "frequency_penalty": st.floats(-2, 2),
        "presence_penalty": st.floats(-2, 2),
    })
    common = {"stream": st.booleans()}
    if route == "/generate":
        prompts = st.one_of(prompt, st.lists(prompt, min_size=1, max_size=3),
                            st.lists(st.integers(0, 300), min_size=1, max_size=20))
        fields = st.fixed_dictionaries({"text": prompts, "sampling_params": sampling}, optional={
            **common, "return_logprob": st.booleans(), "top_logprobs_num": st.integers(0, 3)})
    else:
        base = {"model": st.just(served_model), "max_tokens": st.integers(1, CHEAP_TOKENS)}
        if route == "/v1/completions":
            base["prompt"] = st.one_of(prompt, st.lists(prompt, min_size=1, max_size=3))
            extra = {"logprobs": st.integers(0, 3)}
        else:
            message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                             "content": prompt})
            base["messages"] = st.lists(message, min_size=1, max_size=3)
            extra = {"logprobs": st.booleans()}
        fields = st.tuples(st.fixed_dictionaries(base, optional={**common, **extra, "n": st.integers(1, 3)}),
                           sampling).map(lambda pair: {**pair[1], **pair[0]})
    return fields.map(_input_ids_apart)


def _input_ids_apart(body: dict) -> dict:
    """/generate takes token ids in `input_ids`, not in `text`."""
    text = body.get("text")
    if isinstance(text, list) and text and isinstance(text[0], int):
        body = {**body, "input_ids": body.pop("text")}
    return body


def encoded(body: dict) -> bytes:
    return json.dumps(body).encode()


def hostile(body: dict, choice: int, value: bytes) -> bytes:
    """One of three byte-level corruptions of `body`, picked by `choice`: a field's value replaced by a hostile
    literal, the body truncated, or one byte flipped."""
    raw = encoded(body)
    kind, where = choice % 3, choice // 3
    if kind == 0:
        keys = list(body) or ["text"]
        key = keys[where % len(keys)]
        rest = encoded({k: v for k, v in body.items() if k != key})
        return b"{" + json.dumps(key).encode() + b": " + value + (b", " + rest[1:] if rest != b"{}" else b"}")
    if kind == 1:
        return raw[: where % len(raw)]
    index = where % len(raw)
    return raw[:index] + bytes([raw[index] ^ 0xFF]) + raw[index + 1 :]


def request_bodies(model: type[BaseModel], served_model: str | None,
                   plausible: st.SearchStrategy[dict] | None = None) -> st.SearchStrategy[bytes]:
    """Bodies from the schema and plausible ones, hostile variants of them, and arbitrary bytes."""
    bodies = schema_bodies(model, served_model)
    if plausible is not None:
        bodies = st.one_of(bodies, plausible)
    variants = st.builds(hostile, bodies, st.integers(0, 10**6), st.sampled_from(HOSTILE_VALUES))
    return st.one_of(bodies.map(encoded), variants, st.binary(max_size=256))


def admin_requests() -> st.SearchStrategy[tuple[str, str, bytes | None]]:
    """(method, path, body) for the routes besides generation; /abort_request bodies from its schema."""
    gets = st.sampled_from(["/health", "/get_model_info", "/get_server_info", "/v1/models", "/metrics", "/workers",
                            "/flush_cache", "/no/such/route"]).map(lambda path: ("GET", path, None))
    aborts = request_bodies(AbortRequestInput, None).map(lambda body: ("POST", "/abort_request", body))
    others = st.tuples(st.sampled_from(["POST", "PUT", "DELETE", "PATCH"]),
                       st.sampled_from(["/get_model_info", "/v1/models", "/health", "/metrics", "/flush_cache"]),
                       st.binary(max_size=64))
    return st.one_of(gets, aborts, others)

