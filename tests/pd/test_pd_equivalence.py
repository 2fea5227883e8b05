"""Greedy output through PD (prefill + decode behind the router) is token-identical to a colocated server and
to the offline API, for every way a request can arrive; both KV pools are fully free after every test."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest
from cluster_util import PDCluster, Proc, wait_kv_free

from pdserve import SamplingParams

pytestmark = pytest.mark.timeout(900)  # the first test also pays for starting the servers

MAX_NEW = 12
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "1, 2, 3, 4,"]
LONG_PROMPT_IDS = [(i * 37 + 11) % 1000 + 3 for i in range(100)]  # > 3 chunks of 32
PREFIX_IDS = [(i * 53 + 7) % 1000 + 3 for i in range(80)]  # 5 pages of 16


@pytest.fixture(autouse=True)
def pools_free_after(session_servers):
    yield
    clusters = session_servers["clusters"].values()
    wait_kv_free([session_servers["colocated"], *(s for c in clusters for s in c.servers)])


def generate(proc: Proc, **body) -> dict | list:
    reply = proc.post("/generate", {"sampling_params": GREEDY, **body})
    assert reply.status == 200, reply.body
    return reply.json()


def offline_ids(llm, prompts: list) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def test_single_prompt(pd: PDCluster, colocated: Proc, offline_llm):
    out = generate(pd.router, text=PROMPTS[0])
    assert out["meta_info"]["finish_reason"] == {"type": "length"}
    assert len(out["output_ids"]) == MAX_NEW
    assert out["output_ids"] == generate(colocated, text=PROMPTS[0])["output_ids"]
    assert out["output_ids"] == offline_ids(offline_llm, [PROMPTS[0]])[0]
    assert out["text"] == generate(colocated, text=PROMPTS[0])["text"]


def test_batched_prompts(pd: PDCluster, colocated: Proc, offline_llm):
    outs = generate(pd.router, text=PROMPTS)
    assert isinstance(outs, list) and len(outs) == len(PROMPTS)
    expected = [o["output_ids"] for o in generate(colocated, text=PROMPTS)]
    assert [o["output_ids"] for o in outs] == expected
    assert expected == offline_ids(offline_llm, PROMPTS)


def test_streamed(pd: PDCluster, colocated: Proc):
    reply = pd.router.post("/generate", {"text": PROMPTS[1], "sampling_params": GREEDY, "stream": True})
    assert reply.status == 200, reply.body
    assert reply.body.rstrip().endswith(b"data: [DONE]")
    events = reply.events()
    assert len(events) >= 2  # the first token (from the prefill) and the rest arrive as separate events
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length"}
    assert events[-1]["output_ids"] == generate(colocated, text=PROMPTS[1])["output_ids"]
    assert events[-1]["text"] == generate(colocated, text=PROMPTS[1])["text"]


def test_chunked_prefill(pd: PDCluster, colocated: Proc, offline_llm):
    prefill_args = pd.prefill.get("/get_server_info").json()
    assert len(LONG_PROMPT_IDS) > 3 * prefill_args["chunked_prefill_size"]
    out = generate(pd.router, input_ids=LONG_PROMPT_IDS)
    assert out["meta_info"]["prompt_tokens"] == len(LONG_PROMPT_IDS)
    assert out["output_ids"] == generate(colocated, input_ids=LONG_PROMPT_IDS)["output_ids"]
    assert out["output_ids"] == offline_ids(offline_llm, [LONG_PROMPT_IDS])[0]


def test_prefix_cached(pd: PDCluster, colocated: Proc, offline_llm):
    first, second = PREFIX_IDS + [5, 6, 7, 8, 9], PREFIX_IDS + [900, 901, 902]
    hits_before = pd.prefill.get("/get_server_info").json()["scheduler"]["prefix_hit_tokens"]
    out_first = generate(pd.router, input_ids=first)
    out_second = generate(pd.router, input_ids=second)
    hits = pd.prefill.get("/get_server_info").json()["scheduler"]["prefix_hit_tokens"] - hits_before
    assert hits >= 64, "the second prompt should reuse the first one's prefix pages on the prefill"
    expected = offline_ids(offline_llm, [first, second])
    assert [out_first["output_ids"], out_second["output_ids"]] == expected
    assert out_second["output_ids"] == generate(colocated, input_ids=second)["output_ids"]


def test_concurrent_streams(pd: PDCluster, colocated: Proc):
    """16 streams at once, short and chunked prompts mixed (the tcp pair pushes the chunked ones layer by layer):
    batched prefill, interleaved KV writes of many rooms and batched decode still give each stream the
    colocated server's greedy output."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(4, 120))] for _ in range(16)]

    async def stream(session: aiohttp.ClientSession, url: str, ids: list[int]) -> list[int]:
        body = {"input_ids": ids, "sampling_params": GREEDY, "stream": True}
        async with session.post(url + "/generate", json=body) as resp:
            assert resp.status == 200, await resp.text()
            events = [json.loads(line[6:]) for line in (await resp.text()).split("\n\n")
                      if line.startswith("data: {")]
        return events[-1]["output_ids"]

    async def run_all(url: str) -> list[list[int]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            return await asyncio.gather(*(stream(session, url, ids) for ids in prompts))

    expected = [generate(colocated, input_ids=ids)["output_ids"] for ids in prompts]
    assert asyncio.run(run_all(pd.router.url)) == expected


def test_openai_completions(pd: PDCluster, colocated: Proc):
    openai = pytest.importorskip("openai")
    model = pd.router.get("/v1/models").json()["data"][0]["id"]
    clients = [openai.OpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0) for p in (pd.router, colocated)]
    texts = [c.completions.create(model=model, prompt=PROMPTS[2], max_tokens=MAX_NEW, temperature=0).choices[0]
             for c in clients]
    assert texts[0].text == texts[1].text and texts[0].finish_reason == texts[1].finish_reason
    chats = [c.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                       max_tokens=MAX_NEW, temperature=0).choices[0] for c in clients]
    assert chats[0].message.content == chats[1].message.content
    stream = clients[0].chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                                max_tokens=MAX_NEW, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == chats[1].message.content


def test_direct_request_without_bootstrap_is_refused_by_the_prefill(pd: PDCluster):
    """(The decode server prefills such a request itself: tests/pd/test_conditional_disagg.py.)"""
    reply = pd.prefill.post("/generate", {"text": PROMPTS[0], "sampling_params": GREEDY})
    assert reply.status == 400
    message = reply.json()["error"]["message"]
    assert "PD prefill server" in message and "bootstrap_room" in message and "router" in message


@pytest.mark.parametrize("bad", [{"min_new_tokens": 2, "stop_token_ids": [5000]}, {"top_k": 1e30}],
                         ids=["stop id out of range", "huge top_k"])
def test_bad_input_through_the_router_is_a_400_and_the_cluster_keeps_serving(pd: PDCluster, colocated: Proc, bad):
    reply = pd.router.post("/generate", {"text": PROMPTS[0], "sampling_params": {**GREEDY, **bad}})
    assert reply.status == 400, reply.body
    assert "error" in reply.json()
    expected = generate(colocated, text=PROMPTS[0], sampling_params=GREEDY)["output_ids"]
    assert generate(pd.router, text=PROMPTS[0], sampling_params=GREEDY)["output_ids"] == expected
