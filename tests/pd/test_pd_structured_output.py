"""Structured output through PD (prefill + decode behind the router): the prefill samples the first token under
the grammar, the decode replays it into its own matcher and continues. Greedy constrained output equals the
colocated server's token for token; a bad grammar is a 400 on both sides with both pools freed."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import jsonschema
import pytest
from cluster_util import PDCluster, Proc, wait_kv_free

pytestmark = pytest.mark.timeout(900)  # the first test also pays for starting the servers

SCHEMAS = [
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                      "ok": {"type": "boolean"}}, "required": ["id", "ok"]},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["name", "tags"]},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
]
PROMPTS = ["The capital of France is", "Once upon a time,", "1, 2, 3,"]
MORE_SCHEMAS = [
    {"type": "object", "required": ["kind", "x"],
     "properties": {"kind": {"const": "point"}, "x": {"type": "number", "minimum": -1, "maximum": 1}}},
    {"type": "object", "properties": {"on": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
     "required": ["on", "level"]},
    {"type": "object", "properties": {"who": {"$ref": "#/$defs/person"}}, "required": ["who"],
     "$defs": {"person": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 5}},
                          "required": ["first"]}}},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                      {"type": "string", "maxLength": 3}]}}, "required": ["v"]},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]},
     "minItems": 1, "maxItems": 2},
]


@pytest.fixture(autouse=True)
def pools_free_after(session_servers):
    yield
    clusters = session_servers["clusters"].values()
    wait_kv_free([session_servers["colocated"], *(s for c in clusters for s in c.servers)])


def generate(proc: Proc, text: str, **params) -> dict:
    reply = proc.post("/generate", {"text": text, "sampling_params": {"max_new_tokens": 60, **params}})
    assert reply.status == 200, reply.body
    return reply.json()


@pytest.mark.parametrize("schema", SCHEMAS, ids=["ints", "strings", "array"])
def test_greedy_json_schema_through_pd_equals_colocated(pd: PDCluster, colocated: Proc, schema):
    for prompt in PROMPTS:
        params = {"temperature": 0, "json_schema": json.dumps(schema), "ignore_eos": True}
        out = generate(pd.router, prompt, **params)
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        jsonschema.validate(json.loads(out["text"]), schema)
        assert out["output_ids"] == generate(colocated, prompt, **params)["output_ids"]


def test_sampled_constrained_outputs_through_pd_validate(pd: PDCluster):
    for schema in SCHEMAS:
        for prompt in PROMPTS:
            out = generate(pd.router, prompt, temperature=1.0, json_schema=json.dumps(schema))
            jsonschema.validate(json.loads(out["text"]), schema)
    for prompt in PROMPTS:
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", generate(pd.router, prompt, temperature=1.0,
                                                          regex=r"[A-Z]{2}-[0-9]{3}")["text"])


def test_a_bad_grammar_fails_on_both_sides_and_pd_keeps_serving(pd: PDCluster):
    reply = pd.router.post("/generate", {"text": "hi", "sampling_params": {"regex": "(unclosed"}})
    assert reply.status == 400 and "invalid regex" in reply.body.decode()
    assert generate(pd.router, "hi", temperature=0, regex="[0-9]{3}")["text"].isdigit()


def test_tool_choice_required_through_pd(pd: PDCluster):
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"enum": ["x", "y"]}}, "required": ["q"]}}}
    reply = pd.router.post("/v1/chat/completions", {
        "model": pd.decode.get("/v1/models").json()["data"][0]["id"],
        "messages": [{"role": "user", "content": "look it up"}], "tools": [tool], "tool_choice": "required",
        "temperature": 0, "max_tokens": 60})
    assert reply.status == 200, reply.body
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    for call in choice["message"]["tool_calls"]:
        assert call["function"]["name"] == "lookup" and json.loads(call["function"]["arguments"])["q"] in "xy"


async def _many(url: str, bodies: list[dict]) -> list[dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def one(body: dict) -> dict:
            async with session.post(f"{url}/generate", json=body) as response:
                assert response.status == 200, await response.text()
                return await response.json()
        return await asyncio.gather(*(one(body) for body in bodies))


@pytest.mark.parametrize("target", ["colocated", "pd"])
def test_200_sampled_requests_over_8_schemas_validate(session_servers, target):
    proc = session_servers["colocated"] if target == "colocated" else session_servers["clusters"]["tcp"].router
    schemas = (SCHEMAS + MORE_SCHEMAS) * 25
    bodies = [{"text": PROMPTS[i % 3], "sampling_params": {"temperature": 1.0, "max_new_tokens": 96,
                                                            "json_schema": json.dumps(schema)}}
              for i, schema in enumerate(schemas)]
    outs = asyncio.run(_many(proc.url, bodies))
    finished = [(out, schema) for out, schema in zip(outs, schemas)
                if out["meta_info"]["finish_reason"]["type"] == "stop"]
    assert len(finished) >= 190  # bounded schemas: nearly every output ends within max_new_tokens
    for out, schema in finished:
        jsonschema.validate(json.loads(out["text"]), schema)
