"""Cache-aware routing on what the instances report holding (`--cache-aware-source reported|both`).

Unit level: the report's parsing and bounds, the policy's choice per source, stale reports, the decision labels.
End to end: two prefill instances and a decode (with its own radix cache) behind the router; a prefix served
directly on prefill B (a fake-transfer request, no router involved) is reported by B, and the router sends the
next requests sharing it to B; from the second one on, the decode server already holds the prefix too."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from cluster_util import Proc, decode_server, free_port, prefill_server, router, start_with_router, \
    stop_all, wait_kv_free
from pdserve_router.config import ConfigError, RouterConfig
from pdserve_router.policies import CacheAwarePolicy
from pdserve_router.reported_cache import CacheReport, key_block_hashes, parse_cache_report
from pdserve_router.workers import CircuitBreaker, Worker

from pdserve.messages import FAKE_BOOTSTRAP_HOST
from pdserve.server.prefix_digest import PrefixDigest, block_hashes

BLOCK = 8


def workers(n: int = 3) -> list[Worker]:
    return [Worker(f"http://w{i}:1", "prefill", CircuitBreaker(5, 2, 1.0)) for i in range(n)]


def report(key, blocks: int, tier: str = "device", age_s: float = 0.0) -> CacheReport:
    hashes = frozenset(key_block_hashes(key, BLOCK)[:blocks])
    device, host = (hashes, frozenset()) if tier == "device" else (frozenset(), hashes)
    return CacheReport(BLOCK, device, host, time.monotonic() - age_s)


def policy(source: str, decisions: list[str], **kw) -> CacheAwarePolicy:
    config = RouterConfig(cache_aware_source=source, cache_block_chars=BLOCK, cache_report_ttl_s=5.0, **kw)
    return CacheAwarePolicy(config, decisions.append)


KEY = "the system prompt every request of this tenant shares; then a question"  # 70 characters: 8 full blocks


def test_server_digest_and_router_hash_the_same_blocks():
    for key in (KEY, "naïve ☃ " * 20, list(range(100)), "short"):
        assert block_hashes(key, BLOCK) == key_block_hashes(key, BLOCK)
    assert key_block_hashes(KEY, BLOCK) != key_block_hashes(list(map(ord, KEY)), BLOCK)  # text and ids differ


def test_reported_source_picks_the_instance_holding_the_longest_prefix():
    decisions: list[str] = []
    ws = workers()
    ws[1].cache_report, ws[2].cache_report = report(KEY, 3), report(KEY, 7, tier="host")
    ws[2].in_flight = 1  # busier, but it holds the longer prefix (on its host tier)
    p = policy("reported", decisions)
    assert p.select(ws, KEY) is ws[2]
    ws[1].cache_report = report(KEY, 7)  # the same length on the device tier wins the tie
    assert p.select(ws, KEY) is ws[1]
    assert p.owner == {}  # the reported source keeps no index of its own
    assert decisions == ["reported", "reported"]


def test_stale_reports_and_short_matches_fall_back_to_the_least_loaded():
    decisions: list[str] = []
    ws = workers(2)
    ws[0].in_flight = 1
    ws[0].cache_report = report(KEY, 8, age_s=10.0)  # older than the 5 s ttl
    p = policy("reported", decisions)
    assert p.select(ws, KEY) is ws[1]
    ws[0].cache_report = report(KEY, 2)  # 16 of 70 characters: under the 0.5 threshold
    assert p.select(ws, KEY) is ws[1]
    assert p.select(ws, None) is ws[1]
    assert decisions == ["load", "load", "load"]


def test_both_takes_the_longer_of_the_local_index_and_the_reports():
    decisions: list[str] = []
    ws = workers(2)
    key = KEY[:64]  # whole blocks, so that the local index and a report can match all of it
    p = policy("both", decisions)
    first = p.select(ws, key)  # nothing known: by load, and remembered locally
    other = ws[1] if first is ws[0] else ws[0]
    other.cache_report = report(key, 5)
    assert p.select(ws, key) is first  # the local index matches the whole key, the report 40 characters
    other.cache_report = report(key, 8)
    assert p.select(ws, key) is other  # as long as the local match: the report wins the tie
    assert decisions == ["load", "local", "reported"]


def test_parse_cache_report_refuses_what_is_not_a_bounded_report():
    now = time.monotonic()
    good = {"block_chars": 64, "device": ["00000000000000ff"], "host": ["0000000000000100", "bad", 7]}
    parsed = parse_cache_report(good, max_entries=8, received_at=now)
    assert parsed.device == {255} and parsed.host == {256} and parsed.block_chars == 64
    for body in ([], {"block_chars": 0, "device": [], "host": []}, {"block_chars": 64, "device": {}, "host": []},
                 {"block_chars": True, "device": [], "host": []}, {**good, "device": ["0" * 16] * 8}):
        assert parse_cache_report(body, max_entries=8, received_at=now) is None
    with pytest.raises(ConfigError, match="--cache-aware-source"):
        RouterConfig(cache_aware_source="guess")


def test_digest_splits_tiers_by_capacity_most_recent_first():
    digest = PrefixDigest(enabled=True, block=BLOCK, max_blocks=100)
    old, new = "a" * 32, "b" * 32  # 4 blocks each; 8 tokens per prompt: 2 tokens per block
    digest.record(old, num_tokens=8)
    digest.record(new, num_tokens=8)
    hexes = [[f"{h:016x}" for h in block_hashes(k, BLOCK)] for k in (old, new)]
    got = digest.report(device_tokens=8, host_tokens=4)
    assert got["device"] == hexes[1]  # the newest prompt, its first block first
    assert got["host"] == hexes[0][:2]  # then the older prompt's first blocks, up to the host capacity
    assert PrefixDigest(enabled=False).report(8, 0) == {"block_chars": 64, "device": [], "host": []}
    digest.clear()
    assert digest.report(100, 100)["device"] == []


# ---- end to end ------------------------------------------------------------------------------------------------

PREFIX = ("You are the assistant of a small bakery. Answer in one short sentence, politely, and never invent "
          "prices. Opening hours are seven to noon. ")  # 160 characters: 2 full report blocks of 64 and more
REPORT_INTERVAL_S = "0.2"


@pytest.fixture(scope="module")
def cluster(tiny_model) -> Iterator[dict]:
    ports = free_port(), free_port()
    prefills = [prefill_server(tiny_model, "tcp", port) for port in ports]
    decode = decode_server(tiny_model, "tcp", "--disaggregation-decode-enable-radix-cache")
    front = start_with_router([*prefills, decode], lambda: router(
        list(zip(prefills, ports)), [decode], "--prefill-policy", "cache_aware", "--cache-aware-source", "reported",
        "--cache-report-interval-s", REPORT_INTERVAL_S, "--cache-threshold", "0.5", name="router-reported"))
    yield {"prefills": prefills, "decode": decode, "router": front}
    stop_all([front, *prefills, decode])


def body(text: str, **extra) -> dict:
    return {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 4}, **extra}


def hit_tokens(proc: Proc) -> int:
    return proc.get("/get_server_info").json()["scheduler"]["prefix_hit_tokens"]


def wait_for_router_report(front: Proc, url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        workers = {w["url"]: w for w in front.get("/workers").json()["workers"]}
        if workers[url].get("cache_report", {}).get("device_blocks", 0) > 0:
            return
        assert time.monotonic() < deadline, f"the router never read a report from {url}: {workers[url]}"
        time.sleep(0.1)


def decisions(front: Proc) -> dict[str, float]:
    lines = front.get("/metrics").body.decode().splitlines()
    prefix = 'pdserve_router_cache_aware_decisions_total{role="prefill",source="'
    return {line[len(prefix):].split('"')[0]: float(line.split()[-1]) for line in lines if line.startswith(prefix)}


def test_router_sends_a_prefix_to_the_prefill_that_reports_holding_it(cluster):
    a, b = cluster["prefills"]
    front = cluster["router"]
    direct = b.post("/generate", body(PREFIX + "Who are you?", bootstrap_host=FAKE_BOOTSTRAP_HOST,
                                      bootstrap_room=0))
    assert direct.status == 200, direct.body
    held = b.get("/cache_report").json()
    assert held["block_chars"] == 64 and held["host"] == []
    assert [f"{h:016x}" for h in key_block_hashes(PREFIX, 64)] == held["device"][:2]  # its first blocks, newest
    assert a.get("/cache_report").json()["device"] == []
    wait_for_router_report(front, b.url)
    hits_a, hits_b = hit_tokens(a), hit_tokens(b)
    cached = []  # the decode server's own radix cache: the prefix reached it with the first request
    for question in ("When do you open?", "Do you sell rye bread?", "Is there parking?"):
        reply = front.post("/generate", body(PREFIX + question))
        assert reply.status == 200, reply.body
        cached.append(reply.json()["meta_info"]["cached_tokens"])
    assert hit_tokens(a) == hits_a and hit_tokens(b) > hits_b  # all three went to B, which reused the prefix
    assert decisions(front).get("reported") == 3.0
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == cached[1]
    wait_kv_free([a, b, cluster["decode"]])


def test_a_flushed_cache_is_reported_empty(cluster):
    b = cluster["prefills"][1]
    b.post("/generate", body(PREFIX + "Hello?", bootstrap_host=FAKE_BOOTSTRAP_HOST, bootstrap_room=0))
    assert b.get("/cache_report").json()["device"]
    wait_kv_free([b])
    assert b.post("/flush_cache").status == 200
    assert b.get("/cache_report").json() == {"block_chars": 64, "device": [], "host": []}
