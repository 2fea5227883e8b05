"""SGLang's own clients against pdserve, colocated and through the PD router: the request bodies SGLang's
`bench_serving` sends (fixtures/sglang_bench_serving.json, taken from its source) get 200 and the same greedy output
from both; a field asking for a feature pdserve lacks gets a 400 naming it; OpenAI batch completions (several
prompts, n > 1) get one bootstrap room per item; `/server_info` and `/model_info` answer as `get_*` does."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cluster_util import PDCluster, Proc, Reply, wait_kv_free

pytestmark = pytest.mark.timeout(900)  # the first test also pays for starting the servers

BENCH_SERVING = json.loads((Path(__file__).parent / "fixtures" / "sglang_bench_serving.json").read_text())["bodies"]
PROMPT = "The capital of France is"
OUTPUT_LEN = 6
PROMPT_IDS = list(range(3, 13))


@pytest.fixture(autouse=True)
def pools_free_after(session_servers):
    yield
    clusters = session_servers["clusters"].values()
    wait_kv_free([session_servers["colocated"], *(s for c in clusters for s in c.servers)])


def filled(value, model: str, prompt_ids: list[int]):
    """The fixture's body with its placeholders replaced."""
    if isinstance(value, dict):
        return {k: filled(v, model, prompt_ids) for k, v in value.items()}
    if isinstance(value, list):
        return [filled(v, model, prompt_ids) for v in value]
    if isinstance(value, str):
        return {"PROMPT": PROMPT, "PROMPT_IDS": prompt_ids, "MODEL": model, "OUTPUT_LEN": OUTPUT_LEN}.get(value, value)
    return value


def output_text(reply: Reply, path: str, stream: bool) -> str:
    """The generated text, as bench_serving reads it from each kind of answer."""
    if not stream:
        return reply.json()["text"]
    events = reply.events()
    if path == "/generate":
        return events[-1]["text"]
    key = "text" if path == "/v1/completions" else "delta"
    pieces = [e["choices"][0][key] for e in events if e["choices"]]
    return "".join(p if key == "text" else p.get("content") or "" for p in pieces)


@pytest.mark.parametrize("name", sorted(BENCH_SERVING))
def test_bench_serving_bodies_get_200_colocated_and_through_the_router(name, pd: PDCluster, colocated: Proc):
    model = colocated.get("/get_model_info").json()["served_model_name"]
    request = BENCH_SERVING[name]
    body = filled(request["body"], model, PROMPT_IDS)
    texts = []
    for proc in (colocated, pd.router):
        reply = proc.post(request["path"], body)
        assert reply.status == 200, (proc.name, reply.body[:500])
        texts.append(output_text(reply, request["path"], body["stream"]))
    assert texts[0] == texts[1] and texts[0]


@pytest.mark.parametrize("field, value", [("lora_path", "my-adapter"), ("return_routed_experts", True),
                                          ("custom_logit_processor", "{\"callable\": \"x\"}")])
def test_a_field_asking_for_a_missing_feature_is_a_400_naming_it(field, value, pd: PDCluster, colocated: Proc):
    body = {**BENCH_SERVING["sglang"]["body"], "text": PROMPT, "sampling_params": {"max_new_tokens": 2}, field: value}
    for proc in (colocated, pd.router):
        reply = proc.post("/generate", body)
        assert reply.status == 400, (proc.name, reply.body)
        assert reply.json()["error"]["message"] == f"{field}={value!r} is not supported by this server"
    assert pd.router.post("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}}).status == 200


@pytest.mark.parametrize("n", [1, 2])
def test_openai_batch_completions_through_the_pd_router(n, pd: PDCluster, colocated: Proc):
    model = colocated.get("/get_model_info").json()["served_model_name"]
    body = {"model": model, "prompt": [PROMPT, "Once upon a time", "1, 2, 3,"], "max_tokens": OUTPUT_LEN,
            "temperature": 0, "n": n, "seed": 1}
    replies = [proc.post("/v1/completions", body) for proc in (colocated, pd.router)]
    for reply in replies:
        assert reply.status == 200, reply.body
    choices = [[(c["index"], c["text"]) for c in reply.json()["choices"]] for reply in replies]
    assert len(choices[1]) == 3 * n and choices[0] == choices[1]


def test_a_scalar_room_for_a_batch_is_one_room_per_prompt(pd: PDCluster):
    """A client that brings its own rendezvous (SGLang's mini_lb sends a scalar room with a batch) reaches both
    halves directly."""
    body = {"text": [PROMPT, "Once upon a time"], "sampling_params": {"max_new_tokens": 3},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bootstrap_port, "bootstrap_room": 777}
    with ThreadPoolExecutor(2) as pool:
        prefill, decode = pool.map(lambda proc: proc.post("/generate", body), (pd.prefill, pd.decode))
    assert prefill.status == 200 and decode.status == 200, (prefill.body, decode.body)
    assert len(decode.json()) == 2 and all(item["output_ids"] for item in decode.json())


@pytest.mark.parametrize("route", ["server_info", "model_info"])
def test_info_routes_answer_under_both_names(route, colocated: Proc, pd: PDCluster):
    for proc in (colocated, pd.router):
        plain, prefixed = proc.get(f"/{route}"), proc.get(f"/get_{route}")
        assert plain.status == prefixed.status == 200, (proc.name, route, plain.body[:200])
        assert plain.json().keys() == prefixed.json().keys()
