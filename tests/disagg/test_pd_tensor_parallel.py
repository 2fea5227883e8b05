"""PD with tensor parallelism on the CPU (gloo, fp32), real servers: prefill TP 2 -> decode TP 1, TP 1 -> TP 2 and
TP 2 -> TP 2 answer as a colocated engine does, over tcp and mooncake, with KV heads split across the ranks
(qwen3-tiny: 2 KV heads) and replicated on them (llama-tiny-mqa: 1 KV head), each request's KV checksum equal on
both sides; every pool is free afterwards. The
death of one rank takes its server down and the router takes that server out of rotation."""

from __future__ import annotations

import os
import random
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_util import (NO_MOONCAKE, PD_TIMEOUTS, Proc, free_port, http, mooncake_available, router,
                          scheduler_stats, server, start_all, stop_all, wait_kv_free)

from pdserve import LLM, SamplingParams
from pdserve import server_processes

pytestmark = pytest.mark.timeout(900)  # a module's first test also pays for starting its servers

COMMON = ["--dtype", "float32", "--page-size", "4", "--chunked-prefill-size", "32"]
MAX_NEW = 6
PROMPT_LENGTHS = (3, 29, 70)  # one page, one chunk, three chunks (the last two pushed layer by layer over tcp)
PAIRS = [("p2", "d1"), ("p1", "d2"), ("p2", "d2")]


class PDServers(dict):
    """The module's servers by name (p1, p2: prefill TP 1 and 2; d1, d2: decode TP 1 and 2)."""

    def __init__(self, model: str, backend: str, bootstraps: dict[str, int], procs: dict[str, Proc]):
        super().__init__(procs)
        self.model, self.backend, self.bootstraps = model, backend, bootstraps


def start_servers(model: str, backend: str, log_dir) -> PDServers:
    layerwise = ["--disaggregation-layerwise-min-tokens", "16"] if backend == "tcp" else []
    bootstraps = {"p1": free_port(), "p2": free_port()}
    procs = {}
    for name in ("p1", "p2", "d1", "d2"):
        tp = ["--tp-size", "2"] if name.endswith("2") else []
        if name.startswith("p"):
            role = [*server_processes.prefill_flags(backend, bootstraps[name]), *layerwise]
        else:
            role = [*server_processes.decode_flags(backend), "--num-reserved-decode-tokens", "64",
                    "--disaggregation-enable-kv-checksum"]  # a checksum over every rank's heads on both sides
        procs[name] = server(f"{name}-{backend}", model, *COMMON, *role, *PD_TIMEOUTS, *tp,
                             log_path=str(log_dir / f"{name}-{backend}.log"))
    start_all(list(procs.values()))
    return PDServers(model, backend, bootstraps, procs)


SETS = [  # (model, backend): heads split over the ranks on both backends, replicated ones over tcp
    pytest.param(("qwen3-tiny", "tcp"), id="split-tcp"),
    pytest.param(("qwen3-tiny", "mooncake"), id="split-mooncake",
                 marks=pytest.mark.skipif(not mooncake_available(), reason=NO_MOONCAKE)),
    pytest.param(("llama-tiny-mqa", "tcp"), id="replicated-tcp"),
]


@pytest.fixture(scope="module", params=SETS)
def servers(request, tiny_models, tmp_path_factory) -> Iterator[PDServers]:
    preset, backend = request.param
    started = start_servers(tiny_models[preset], backend, tmp_path_factory.mktemp("logs"))
    yield started
    stop_all(started.values())


@pytest.fixture(scope="module")
def expected(servers) -> dict[tuple[int, ...], list[int]]:
    """Greedy output of a colocated engine (TP 1) for each prompt."""
    rng = random.Random(11)
    prompts = [tuple(rng.randrange(3, 900) for _ in range(n)) for n in PROMPT_LENGTHS]
    llm = LLM(servers.model, device="cpu", dtype="float32", page_size=4, chunked_prefill_size=32,
              max_total_tokens=4096, context_length=512)
    try:
        outs = llm.generate([list(p) for p in prompts], greedy(), use_tqdm=False)
    finally:
        llm.shutdown()
    return {p: o.token_ids for p, o in zip(prompts, outs)}


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def pd_generate(prefill: Proc, bootstrap_port: int, decode: Proc, prompt: tuple[int, ...], room: int) -> list[int]:
    """What the router does: the same body, with the bootstrap fields, to both halves at once."""
    body = {"input_ids": list(prompt), "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
            "bootstrap_room": room, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW,
                                                        "ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:
        prefill_reply = pool.submit(prefill.post, "/generate", body)
        decode_reply = decode.post("/generate", body)
    assert prefill_reply.result().status == 200, prefill_reply.result().body
    assert decode_reply.status == 200, decode_reply.body
    return decode_reply.json()["output_ids"]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-to-{p[1]}")
def test_pd_with_tensor_parallelism_equals_colocated(servers, expected, pair):
    prefill, decode = servers[pair[0]], servers[pair[1]]
    bootstrap = servers.bootstraps[pair[0]]
    rooms = random.Random(str(pair)).sample(range(1, 2**62), len(expected))
    with ThreadPoolExecutor(len(expected)) as pool:  # concurrent: the ranks batch them the same way
        outs = list(pool.map(lambda args: pd_generate(prefill, bootstrap, decode, *args), zip(expected, rooms)))
    assert outs == list(expected.values())
    wait_kv_free([prefill, decode])
    for proc in (prefill, decode):
        assert not any(scheduler_stats(proc)["kv_transfer"]["failures"].values())


def test_the_bootstrap_route_describes_every_prefill_rank(servers):
    route = http("GET", f"http://127.0.0.1:{servers.bootstraps['p2']}/route").json()
    assert route["tp_size"] == 2 and sorted(route["ranks"]) == ["0", "1"]
    assert len({rank["transfer_session"] for rank in route["ranks"].values()}) == 2  # one transfer engine per rank
    layout = route["kv_layout"]
    assert layout["num_kv_heads"] == max(1, layout["total_kv_heads"] // 2)


def test_deadlines_end_a_half_served_request_on_every_rank(servers):
    """A TP 2 prefill whose room no decode claims, and a TP 2 decode whose prefill never computes the room's KV,
    both end the request when the leader's clock says so: a 504, and every rank's pool free (the leader
    answers only once every rank has freed the same pages)."""
    body = {"input_ids": list(range(5, 45)), "bootstrap_host": "127.0.0.1", "bootstrap_port": servers.bootstraps["p2"],
            "sampling_params": {"max_new_tokens": 4}}
    with ThreadPoolExecutor(2) as pool:  # both wait out their 6 s deadline at once
        unclaimed = pool.submit(servers["p2"].post, "/generate", {**body, "bootstrap_room": 7001})
        never_filled = pool.submit(servers["d2"].post, "/generate", {**body, "bootstrap_room": 7002})
    assert unclaimed.result().status == 504 and "no decode server claimed" in unclaimed.result().body.decode()
    assert never_filled.result().status == 504 and "KV transfer timed out" in never_filled.result().body.decode()
    wait_kv_free([servers["p2"], servers["d2"]])


def follower_pid(proc: Proc) -> int:
    with open(proc.log_path, errors="replace") as f:
        return int(re.search(r"started the scheduler-tp1 process \(pid (\d+)\)", f.read()).group(1))


def test_a_dead_rank_stops_its_server_and_the_router_drops_it(servers):
    rr = router([(servers["p2"], servers.bootstraps["p2"])], [servers["d1"], servers["d2"]],
                "--decode-policy", "round_robin", "--health-failure-threshold", "2")
    start_all([rr])
    try:
        victim = servers["d2"]
        os.kill(follower_pid(victim), signal.SIGKILL)
        assert victim.proc.wait(30) == 1
        body = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
        deadline = time.monotonic() + 15
        while any(w["healthy"] for w in rr.get("/workers").json()["workers"] if w["url"] == victim.url):
            assert time.monotonic() < deadline, "the dead decode server is still in rotation"
            time.sleep(0.2)
        for _ in range(2):
            reply = rr.post("/generate", body)
            assert reply.status == 200, reply.body
        prefill = servers["p2"]
        os.kill(follower_pid(prefill), signal.SIGKILL)
        assert prefill.proc.wait(30) == 1
    finally:
        stop_all([rr])
