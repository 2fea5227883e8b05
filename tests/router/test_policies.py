"""Each policy spreads load as specified (router process + stub servers)."""

from __future__ import annotations

import random
import string
import threading
import time


def served(*servers) -> list[int]:
    return [len(s.requests) for s in servers]


def test_round_robin_alternates_exactly(stubs, start_router):
    p1, p2, d1, d2 = stubs.add("prefill"), stubs.add("prefill"), stubs.add("decode"), stubs.add("decode")
    router = start_router("--prefill", p1.url, p2.url, "--decode", d1.url, d2.url,
                          "--prefill-policy", "round_robin", "--decode-policy", "round_robin")
    for i in range(10):
        assert router.post("/generate", {"text": f"q{i}"}).status == 200
    assert served(p1, p2) == [5, 5] and served(d1, d2) == [5, 5]


def test_random_uses_every_instance(stubs, start_router):
    d1, d2, p1 = stubs.add("decode"), stubs.add("decode"), stubs.add("prefill")
    router = start_router("--prefill", p1.url, "--decode", d1.url, d2.url, "--decode-policy", "random")
    for i in range(40):
        assert router.post("/generate", {"text": f"q{i}"}).status == 200
    assert min(served(d1, d2)) > 0 and sum(served(d1, d2)) == 40


def test_least_load_avoids_the_busy_instance(stubs, start_router):
    p1, d1, d2 = stubs.add("prefill"), stubs.add("decode", held=True), stubs.add("decode", held=True)
    router = start_router("--prefill", p1.url, "--decode", d1.url, d2.url, "--decode-policy", "least_load")
    long_one = threading.Thread(target=router.post, args=("/generate", {"text": "long", "stream": True}))
    long_one.start()
    deadline = time.monotonic() + 10
    while d1.in_flight + d2.in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    busy, idle = (d1, d2) if d1.in_flight else (d2, d1)
    stubs.release(idle)
    for i in range(5):
        assert router.post("/generate", {"text": f"short {i}"}).status == 200
    assert busy.in_flight == 1  # the long stream was in flight during every short one
    stubs.release(busy)
    long_one.join()
    assert len(busy.requests) == 1 and len(idle.requests) == 5


def random_prompt(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_letters, k=64))


def test_cache_aware_keeps_a_prefix_on_one_prefill_and_spreads_others(stubs, start_router):
    p1, p2, d1 = stubs.add("prefill"), stubs.add("prefill"), stubs.add("decode")
    router = start_router("--prefill", p1.url, p2.url, "--decode", d1.url, "--prefill-policy", "cache_aware")
    rng = random.Random(0)
    shared = random_prompt(rng)
    for i in range(10):
        assert router.post("/generate", {"text": shared + f" question {i}"}).status == 200
    assert sorted(served(p1, p2)) == [0, 10]
    for _ in range(20):
        assert router.post("/v1/completions", {"prompt": random_prompt(rng)}).status == 200
    assert min(served(p1, p2)) > 0


def test_cache_aware_yields_to_the_load_balance_threshold(stubs, start_router):
    p1, p2 = stubs.add("prefill", response_delay_s=1.5), stubs.add("prefill", response_delay_s=1.5)
    d1 = stubs.add("decode")
    router = start_router("--prefill", p1.url, p2.url, "--decode", d1.url, "--prefill-policy", "cache_aware",
                          "--balance-abs-threshold", "1", "--balance-rel-threshold", "1.5")
    shared = random_prompt(random.Random(1))
    chosen = []
    for i in range(3):  # streams finish without waiting for the slow prefill responses, so prefill load piles up
        before = served(p1, p2)
        assert router.post("/generate", {"text": shared + str(i), "stream": True}).status == 200
        chosen.append(0 if served(p1, p2)[0] > before[0] else 1)
    assert chosen[0] == chosen[1] != chosen[2]
