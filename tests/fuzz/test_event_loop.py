"""Size limits come before any heavy work, and tokenization runs off the event loop: `/health` keeps answering
fast while a server refuses or tokenizes a huge request."""

from __future__ import annotations

import json
import random
import string
import threading
import time

from fuzz_util import send

HEALTH_BUDGET_S = 0.5


def health_latencies_during(url: str, path: str, body: bytes) -> tuple[list[float], object]:
    """Send `body` to `path` and probe `/health` until its answer arrives; the probes' latencies and the answer."""
    answer: dict = {}
    worker = threading.Thread(target=lambda: answer.setdefault("reply", send(url, "POST", path, body)))
    worker.start()
    latencies = []
    while worker.is_alive() or not latencies:
        started = time.perf_counter()
        assert send(url, "GET", "/health", timeout=10).status == 200
        latencies.append(time.perf_counter() - started)
        time.sleep(0.02)
    worker.join()
    return latencies, answer["reply"]


def random_words(rng: random.Random, chars: int) -> str:
    """Distinct words, so that the tokenizer's word cache does not make the work trivial."""
    letters = rng.choices(string.ascii_lowercase + "     ", k=chars)
    return "".join(letters)


def too_long_for_the_context(error: dict) -> bool:
    return error["code"] == 400 and error["type"] == "invalid_request_error" and "context" in error["message"]


def test_a_10_mb_prompt_is_refused_without_stalling_health(targets):
    body = json.dumps({"text": "x" * 10_000_000, "sampling_params": {"max_new_tokens": 1}}).encode()
    latencies, reply = health_latencies_during(targets.colocated.url, "/generate", body)
    assert reply.status == 400 and too_long_for_the_context(json.loads(reply.body)["error"]), reply
    assert max(latencies) < HEALTH_BUDGET_S, latencies


def test_100k_prompts_are_refused_before_tokenizing(targets):
    body = json.dumps({"model": "m", "prompt": ["hello there"] * 100_000}).encode()
    model = targets.colocated.get("/v1/models").json()["data"][0]["id"]
    body = body.replace(b'"model": "m"', json.dumps({"model": model}).encode()[1:-1])
    latencies, reply = health_latencies_during(targets.colocated.url, "/v1/completions", body)
    assert reply.status == 400 and b"--max-batch-items" in reply.body, reply
    assert max(latencies) < HEALTH_BUDGET_S, latencies


def test_a_batch_of_long_prompts_is_tokenized_off_the_event_loop(targets):
    """A full batch of prompts that fit the context, then one too long for it (though under the character limit):
    all are tokenized (seconds of work on a CPU) before the last is refused; meanwhile /health answers."""
    info = targets.colocated.get("/get_server_info").json()
    context, items = info["model_info"]["max_context_len"], info["max_batch_items"]
    texts = [random_words(random.Random(seed), context - 8) for seed in range(items - 1)]
    texts.append(random_words(random.Random(items), context * 8))
    body = json.dumps({"text": texts, "sampling_params": {"max_new_tokens": 1}}).encode()
    latencies, reply = health_latencies_during(targets.colocated.url, "/generate", body)
    assert reply.status == 400 and too_long_for_the_context(json.loads(reply.body)["error"]), reply
    assert max(latencies) < HEALTH_BUDGET_S, latencies
