"""The real server process with a tiny model: routes, equality with the offline API, streaming,
concurrency, disconnects, bad input, metrics, and a clean SIGTERM (last test)."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from cluster_util import process_info
from server_util import API_KEY, CONTEXT_LENGTH, MAX_BATCH_ITEMS, Reply, ServerProcess, parse_prometheus, start_server
from transformers import AutoTokenizer

from pdserve import LLM, SamplingParams

openai = pytest.importorskip("openai")  # the GPU image has no openai client; CI installs it

PROMPT = "The quick brown fox"
MAX_TOKENS = 12
SEED_BODY = {"text": "请介绍一下你自己", "max_new_tokens": 32, "temperature": 0.7}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[ServerProcess]:
    """This module's own server: its last test stops it with SIGTERM."""
    proc = start_server(tiny_model, tmp_path_factory)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def offline(tiny_model) -> LLM:
    return LLM(tiny_model, device="cpu", context_length=CONTEXT_LENGTH, max_total_tokens=16384)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def greedy(offline: LLM, prompt, max_tokens: int = MAX_TOKENS, **kwargs) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)
    return offline.generate(prompt, params, use_tqdm=False)[0].text


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def model_name(server: ServerProcess) -> str:
    return server.model_path


# --- the seeds' request and greedy equality ------------------------------------------------------------


def test_seed_curl_body_is_honoured(server, offline):
    reply = server.post("/generate", SEED_BODY)
    assert reply.status == 200, reply.body
    result = reply.json()
    meta = result["meta_info"]
    assert meta["prompt_tokens"] == len(offline.tokenizer.encode(SEED_BODY["text"]))
    assert meta["completion_tokens"] == 32 or meta["finish_reason"]["type"] == "stop"
    assert len(result["output_ids"]) == meta["completion_tokens"]
    assert meta["e2e_latency"] > 0 and meta["ttft"] > 0 and "cached_tokens" in meta
    # temperature 0.7 is honoured: sampling from a random model does not reproduce the greedy tokens
    greedy_ids = offline.generate(SEED_BODY["text"], SamplingParams(temperature=0.0, max_tokens=32),
                                  use_tqdm=False)[0].token_ids
    assert result["output_ids"] != greedy_ids


def test_generate_matches_offline_greedy(server, offline):
    expected = greedy(offline, PROMPT)
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}
    assert server.post("/generate", body).json()["text"] == expected
    ids = offline.tokenizer.encode(PROMPT)
    assert server.post("/generate", {"input_ids": ids, "max_new_tokens": MAX_TOKENS, "temperature": 0}).json()[
        "text"] == expected
    events = server.post("/generate", {**body, "stream": True}).events()
    assert len(events) > 1 and events[-1]["text"] == expected
    assert all(later["text"].startswith(earlier["text"]) for earlier, later in zip(events, events[1:]))


def test_batch_generate_returns_a_list_in_order(server, offline):
    prompts = [PROMPT, "Once upon a time", "Science is a way"]
    reply = server.post("/generate", {"text": prompts, "max_new_tokens": 6, "temperature": 0})
    assert [r["text"] for r in reply.json()] == [greedy(offline, p, 6) for p in prompts]
    events = server.post("/generate", {"text": prompts, "max_new_tokens": 6, "temperature": 0, "stream": True}).events()
    assert {e["index"] for e in events} == {0, 1, 2}


def test_openai_package_completions_match_offline(server, offline, client):
    expected = greedy(offline, PROMPT)
    result = client.completions.create(model=model_name(server), prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert result.choices[0].text == expected
    assert result.usage.completion_tokens == MAX_TOKENS and result.choices[0].finish_reason == "length"
    stream = client.completions.create(model=model_name(server), prompt=PROMPT, max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_openai_package_chat_matches_offline(server, offline, client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about foxes."}]
    expected = greedy(offline, chat_ids(tokenizer, messages))
    result = client.chat.completions.create(model=model_name(server), messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0)
    assert result.choices[0].message.content == expected
    assert result.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=model_name(server), messages=messages, temperature=0,
                                            max_completion_tokens=MAX_TOKENS, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-2].choices[0].finish_reason == "length"


def test_raw_sse_matches_offline(server, offline):
    expected = greedy(offline, PROMPT)
    body = {"model": model_name(server), "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    events = server.post("/v1/completions", body).events()
    assert "".join(e["choices"][0]["text"] for e in events) == expected
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_string_cuts_text_before_it(server, offline, client):
    full = greedy(offline, PROMPT)
    stop = full[3:6]
    expected = full[: full.find(stop)]
    body = {"text": PROMPT, "max_new_tokens": MAX_TOKENS, "temperature": 0, "stop": stop}
    result = server.post("/generate", body).json()
    assert result["text"] == expected
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert server.post("/generate", {**body, "stream": True}).events()[-1]["text"] == expected
    chat = client.completions.create(model=model_name(server), prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in chat) == expected


def test_n_choices_and_seed(server, client):
    kwargs = dict(model=model_name(server), messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                  temperature=1.0, n=3, seed=1234)
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert len({c.message.content for c in first.choices}) > 1, "each choice samples with its own seed"
    assert first.usage.completion_tokens == sum(
        len(c.message.content) and 8 for c in first.choices) or first.usage.completion_tokens <= 24


def test_logprobs(server, client):
    body = {"text": PROMPT, "max_new_tokens": 4, "temperature": 0, "return_logprob": True, "top_logprobs_num": 2,
            "logprob_start_len": 0}
    meta = server.post("/generate", body).json()["meta_info"]
    assert len(meta["output_token_logprobs"]) == 4
    logprob, token_id, text = meta["output_token_logprobs"][0]
    assert logprob <= 0 and isinstance(token_id, int) and isinstance(text, str)
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert meta["output_top_logprobs"][0][0][1] == token_id  # greedy: the sampled token is the best one
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    chat = client.chat.completions.create(model=model_name(server), messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 3 for entry in content)
    completion = client.completions.create(model=model_name(server), prompt=PROMPT, max_tokens=4, temperature=0,
                                           logprobs=2)
    assert len(completion.choices[0].logprobs.token_logprobs) == 4


def sglang_entry(entry: list, with_text: bool) -> bool:
    """SGLang's meta_info order, (logprob, token_id, text): text a string with return_text_in_logprobs, else null."""
    logprob, token_id, text = entry
    return ((logprob is None or logprob <= 0) and type(token_id) is int
            and (isinstance(text, str) if with_text else text is None))


@pytest.mark.parametrize("with_text", [True, False])
def test_every_logprob_list_is_in_sglangs_order(server, with_text):
    body = {"text": PROMPT, "max_new_tokens": 3, "temperature": 0, "return_logprob": True, "top_logprobs_num": 2,
            "logprob_start_len": 0, "return_text_in_logprobs": with_text}
    reply = server.post("/generate", body).json()
    meta = reply["meta_info"]
    singles = meta["input_token_logprobs"] + meta["output_token_logprobs"]
    tops = [e for top in meta["input_top_logprobs"] + meta["output_top_logprobs"] if top is not None for e in top]
    assert len(tops) >= 2 * (meta["prompt_tokens"] - 1 + 3), meta
    assert all(sglang_entry(e, with_text) for e in singles + tops), meta
    assert meta["input_top_logprobs"][0] is None  # the first prompt token has nothing before it
    assert [e[1] for e in meta["output_token_logprobs"]] == reply["output_ids"]


# --- concurrency and disconnects ---------------------------------------------------------------------


async def _stream_generate(session: aiohttp.ClientSession, url: str, prompt: str) -> list[dict]:
    body = {"text": prompt, "max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
    async with session.post(f"{url}/generate", json=body) as response:
        assert response.status == 200
        raw = (await response.read()).decode()
    return Reply(200, raw.encode()).events()


def test_64_concurrent_streaming_clients(server):
    async def run() -> list[list[dict]]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=120)) as session:
            prompts = [f"Request number {i} says hello" for i in range(64)]
            return await asyncio.gather(*(_stream_generate(session, server.url, p) for p in prompts))

    results = asyncio.run(run())
    for events in results:
        meta = events[-1]["meta_info"]
        assert meta["completion_tokens"] == 8 and meta["finish_reason"]["type"] == "length"
        assert len(events[-1]["output_ids"]) == 8
    assert wait_idle(server)["kv_pool_fully_free"]


def wait_idle(server: ServerProcess, timeout: float = 15.0) -> dict:
    """Scheduler stats once no request is left anywhere (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        info = server.get("/get_server_info").json()
        stats = info["scheduler"]
        idle = info["requests_in_flight"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
        if idle and stats["kv_pool_fully_free"] or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def aborted_count(server: ServerProcess) -> float:
    samples = parse_prometheus(server.get("/metrics").body.decode())
    return samples.get('pdserve_requests_finished_total{finish_reason="abort"}', 0.0)


def test_disconnected_stream_is_aborted_and_frees_kv(server):
    before = aborted_count(server)

    async def read_a_little_then_leave() -> None:
        body = {"text": PROMPT, "max_new_tokens": 200, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
            async with session.post(f"{server.url}/generate", json=body) as response:
                for _ in range(3):
                    await response.content.readuntil(b"\n\n")

    asyncio.run(read_a_little_then_leave())
    stats = wait_idle(server, timeout=10)
    assert stats["num_running"] == 0 and stats["kv_pool_fully_free"], stats
    assert aborted_count(server) == before + 1


def test_disconnected_non_streaming_request_is_aborted(server):
    before = aborted_count(server)

    async def give_up_early() -> None:
        # 240 decode steps of a batch of 8 cannot finish within the client's 0.3 s on a CPU
        body = {"text": [PROMPT] * 8, "max_new_tokens": 240, "ignore_eos": True}
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
            with pytest.raises(asyncio.TimeoutError):
                await session.post(f"{server.url}/generate", json=body, timeout=aiohttp.ClientTimeout(total=0.3))

    asyncio.run(give_up_early())
    stats = wait_idle(server, timeout=10)
    assert stats["num_running"] == 0 and stats["kv_pool_fully_free"], stats
    assert aborted_count(server) == before + 8


def test_duplicate_in_flight_rid_is_refused_and_abort_request_works(server):
    async def run() -> tuple[int, list[dict]]:
        body = {"text": PROMPT, "max_new_tokens": 200, "ignore_eos": True, "stream": True, "rid": "dup-rid"}
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
            async with session.post(f"{server.url}/generate", json=body) as response:
                await response.content.readuntil(b"\n\n")
                duplicate = await asyncio.to_thread(server.post, "/generate", {**body, "stream": False})
                aborted = await asyncio.to_thread(server.post, "/abort_request", {"rid": "dup-rid"})
                assert aborted.status == 200, aborted.body
                rest = (await response.read()).decode()
        return duplicate.status, Reply(200, rest.encode()).events()

    status, events = asyncio.run(run())
    assert status == 400
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert wait_idle(server)["kv_pool_fully_free"]


# --- bad input ------------------------------------------------------------------------------------------


def _chat(**fields) -> dict:
    return {"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], **fields}


# what pydantic says that a client cannot act on: the union members it tried, its own wording and class names
PYDANTIC_INTERNALS = re.compile(r"Input should|Extra inputs|Field required|list\[|dict\[|constrained-|instance of|"
                                r"Fields\b|ReqInput")
BAD_REQUESTS = [
    ("malformed json", "/generate", b'{"text": ', 400),
    ("not an object", "/generate", b"[1, 2]", 400),
    ("wrong type", "/generate", {"text": 5}, 400),
    ("wrong type of limit", "/generate", {"text": "hi", "max_new_tokens": "many"}, 400),
    ("unknown field", "/generate", {"text": "hi", "max_new_tokenz": 3}, 400),
    ("no prompt", "/generate", {"max_new_tokens": 3}, 400),
    ("two prompts", "/generate", {"text": "hi", "input_ids": [1]}, 400),
    ("empty text", "/generate", {"text": ""}, 400),
    ("empty ids", "/generate", {"input_ids": []}, 400),
    ("negative limit", "/generate", {"text": "hi", "max_new_tokens": -1}, 400),
    ("absurd limit", "/generate", {"text": "hi", "max_new_tokens": 10**9}, 400),
    ("negative temperature", "/generate", {"text": "hi", "temperature": -1}, 400),
    ("absurd top logprobs", "/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 1000}, 400),
    ("token id out of range", "/generate", {"input_ids": [10**6]}, 400),
    ("prompt longer than context", "/generate", {"input_ids": [5] * (CONTEXT_LENGTH + 10)}, 400),
    ("batch too large", "/generate", {"text": ["hi"] * (MAX_BATCH_ITEMS + 1)}, 400),
    ("empty batch", "/generate", {"text": []}, 400),
    ("duplicate rids in batch", "/generate", {"text": ["a", "b"], "rid": ["x", "x"]}, 400),
    ("sampling params list of wrong length", "/generate", {"text": ["a", "b"], "sampling_params": [{}]}, 400),
    ("unknown model", "/v1/chat/completions", {**_chat(), "model": "gpt-4"}, 404),
    ("no messages", "/v1/chat/completions", {**_chat(), "messages": []}, 400),
    ("bad role", "/v1/chat/completions", {**_chat(), "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("n zero", "/v1/chat/completions", _chat(n=0), 400),
    ("n times prompts too large", "/v1/completions",
     {"model": "MODEL", "prompt": ["a", "b", "c"], "n": MAX_BATCH_ITEMS}, 400),
    ("negative max_tokens", "/v1/chat/completions", _chat(max_tokens=-5), 400),
    ("top_logprobs without logprobs", "/v1/chat/completions", _chat(top_logprobs=2), 400),
    ("too many top_logprobs", "/v1/chat/completions", _chat(logprobs=True, top_logprobs=50), 400),
    ("bad top_p", "/v1/chat/completions", _chat(top_p=0), 400),
    ("tools on completions", "/v1/completions",
     {"model": "MODEL", "prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    ("empty completion prompt", "/v1/completions", {"model": "MODEL", "prompt": ""}, 400),
    ("long completion prompt", "/v1/completions", {"model": "MODEL", "prompt": [7] * (CONTEXT_LENGTH + 1)}, 400),
    ("stop token id out of range", "/generate", {"text": "hi", "min_new_tokens": 2, "stop_token_ids": [5000]}, 400),
    ("chat stop token id out of range", "/v1/chat/completions", _chat(min_tokens=2, stop_token_ids=[99999]), 400),
    ("completion stop token id out of range", "/v1/completions",
     {"model": "MODEL", "prompt": "hi", "min_tokens": 2, "stop_token_ids": [99999]}, 400),
    ("huge top_k", "/generate", {"text": "hi", "top_k": 1e30}, 400),
    ("huge chat top_k", "/v1/chat/completions", _chat(top_k=1e30), 400),
    ("NaN temperature", "/generate", {"text": "hi", "temperature": float("nan")}, 400),
    ("infinite repetition penalty", "/generate", {"text": "hi", "repetition_penalty": float("inf")}, 400),
    ("NaN chat min_p", "/v1/chat/completions", _chat(min_p=float("nan")), 400),
    ("huge logprob start", "/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": 10**30}, 400),
    ("huge sampling seed", "/generate", {"text": "hi", "sampling_seed": 10**30}, 400),
    ("abort unknown rid", "/abort_request", {"rid": "nope"}, 404),
    ("unknown route", "/v2/everything", {}, 404),
]


@pytest.mark.parametrize("name,path,body,status", BAD_REQUESTS, ids=[case[0] for case in BAD_REQUESTS])
def test_bad_requests_get_openai_style_errors(server, name, path, body, status):
    if isinstance(body, dict) and body.get("model") == "MODEL":
        body = {**body, "model": model_name(server)}
    reply = server.post(path, body)
    assert reply.status == status, reply.body
    error = reply.json()["error"]
    assert error["message"] and not PYDANTIC_INTERNALS.search(error["message"]), error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert error["code"] == status
    assert server.get("/health").status == 200


def test_unknown_openai_fields_are_ignored_and_logged_once_per_name(server, client):
    kwargs = dict(model=model_name(server), messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    for extra in ({"guided_choice_x": ["a"]}, {"guided_choice_x": ["b"], "top_a": 0.1}):
        assert client.chat.completions.create(**kwargs, extra_body=extra).choices[0].finish_reason == "length"
    log = Path(server.log_path).read_text()
    for name in ("guided_choice_x", "top_a"):
        assert log.count(f"the request field '{name}' is not implemented and was ignored") == 1, log[-2000:]


def test_wrong_method_and_missing_key_keep_the_error_shape(server):
    wrong_method = server.request("GET", "/generate")
    no_key = server.request("GET", "/v1/models", auth=False)
    assert wrong_method.json()["error"] == {"message": "Method Not Allowed", "type": "invalid_request_error",
                                            "code": 405}
    assert no_key.json()["error"]["type"] == "authentication_error" and no_key.json()["error"]["code"] == 401


def test_api_key_protects_every_route_but_health(server):
    assert server.get("/health", auth=False).status == 200
    for method, path in [("GET", "/health_generate"), ("GET", "/metrics"), ("GET", "/v1/models"),
                         ("POST", "/generate"), ("GET", "/get_server_info"), ("POST", "/flush_cache")]:
        reply = server.request(method, path, {"text": "hi"} if method == "POST" else None, auth=False)
        assert reply.status == 401 and reply.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_a_refused_request_id_can_be_used_again(server):
    for bad in ({"top_k": 1e30}, {"stop_token_ids": [5000], "min_new_tokens": 2}, {"logprob_start_len": 10**30}):
        assert server.post("/generate", {"text": "hi", "rid": "again", **bad}).status == 400
        reply = server.post("/generate", {"text": "hi", "rid": "again", "max_new_tokens": 2})
        assert reply.status == 200, reply.body


def test_server_still_serves_after_bad_input(server, offline):
    assert server.post("/generate", {"text": PROMPT, "max_new_tokens": MAX_TOKENS, "temperature": 0}).json()[
        "text"] == greedy(offline, PROMPT)


# --- info, health, metrics ------------------------------------------------------------------------------


def test_info_routes(server, client):
    assert server.get("/health_generate").status == 200
    info = server.get("/get_model_info").json()
    assert info["max_context_len"] == CONTEXT_LENGTH and info["vocab_size"] > 0 and info["is_generation"]
    server_info = server.get("/get_server_info").json()
    assert "api_key" not in server_info and server_info["context_length"] == CONTEXT_LENGTH
    assert {"num_running", "kv_total_tokens"} <= set(server_info["scheduler"])
    assert [m.id for m in client.models.list()] == [model_name(server)]
    wait_idle(server)
    flushed = server.post("/flush_cache", {})
    assert flushed.status == 200 and flushed.json()["success"]


def test_metrics_parse_and_move(server):
    before = parse_prometheus(server.get("/metrics").body.decode())
    body = {"text": "We measure, we compare, we make a model. " * 6, "max_new_tokens": 5, "ignore_eos": True}
    assert server.post("/generate", body).status == 200
    assert server.post("/generate", body).status == 200  # its prompt's full pages come from the prefix cache
    assert server.post("/generate", {"text": ""}).status == 400
    after = parse_prometheus(server.get("/metrics").body.decode())
    assert after["pdserve_requests_received_total"] == before["pdserve_requests_received_total"] + 2
    assert after["pdserve_generation_tokens_total"] == before["pdserve_generation_tokens_total"] + 10
    assert after["pdserve_time_to_first_token_seconds_count"] == before["pdserve_time_to_first_token_seconds_count"] + 2
    assert after["pdserve_inter_token_latency_seconds_count"] == before["pdserve_inter_token_latency_seconds_count"] + 8
    assert after["pdserve_e2e_request_latency_seconds_count"] == before["pdserve_e2e_request_latency_seconds_count"] + 2
    assert after["pdserve_prefix_cache_hit_tokens_total"] > before["pdserve_prefix_cache_hit_tokens_total"]
    assert 0 < after["pdserve_prefix_cache_hit_rate"] <= 1
    assert after["pdserve_kv_cache_total_tokens"] > 0
    assert {"pdserve_num_running_reqs", "pdserve_num_queue_reqs", "pdserve_kv_cache_usage_ratio"} <= set(after)
    errors = 'pdserve_http_errors_total{status="400"}'
    assert after[errors] == before.get(errors, 0) + 1


# --- shutdown (keep last: it stops the module's server) -------------------------------------------------


def test_sigterm_leaves_no_process_behind(server):
    children = server.descendants()
    assert len(children) >= 2, "scheduler and detokenizer run as child processes"
    assert server.stop(signal.SIGTERM) == 0
    deadline = time.monotonic() + 10
    while any(process_info(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if process_info(pid)]
    assert "Traceback" not in server.log(), server.log()
