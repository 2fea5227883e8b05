"""The fault matrix: kill -9 or SIGSTOP/SIGCONT of the prefill, the decode or the router at each point of a
request's life, over tcp and mooncake. Each cell checks that the affected request ends (with an error where
the fault reaches it) within the configured timeout, that the surviving servers free their KV pools within
seconds, that nothing of a killed process is left behind, and that the restarted process serves again through
the router within 10 s. A few cells run by default; `-m chaos_full` runs them all.

Landing in a phase is deterministic: the servers pause STEP_DELAY before every scheduler step (the test-only
PDSERVE_TEST_STEP_DELAY_S), prompts of 448 tokens are prefilled in chunks of 8 (layer-wise pushes, so the
transfer runs with the prefill) and 240 output tokens keep a request decoding: each phase lasts seconds.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from chaos_util import POOL, Stream, holds_pages, prompt_ids, wait_pool_free, wait_until
from pdserve.scheduler.process import STEP_DELAY_ENV
from cluster_util import (PDCluster, Proc, decode_server, free_port, http, live_session_members, prefill_server,
                          router, scheduler_stats, start_all, start_with_router, stop_all)

WAITING_TIMEOUT = 30.0  # the transfer timeout: survivors must free pages well before it
CHAOS_PREFILL = ["--chunked-prefill-size", "8", "--disaggregation-layerwise-min-tokens", "8",
                 "--disaggregation-waiting-timeout", str(WAITING_TIMEOUT)]
CHAOS_DECODE = ["--disaggregation-waiting-timeout", str(WAITING_TIMEOUT)]
SURVIVOR_FREE_SECONDS = 8.0
VICTIM_END_SECONDS = WAITING_TIMEOUT + 10
RECOVERY_SECONDS = 10.0
FREEZE_SECONDS = 3.0
LONG_PROMPT, SHORT_PROMPT, LONG_OUTPUT = 448, 16, 240
STEP_DELAY = {STEP_DELAY_ENV: "0.03"}

PHASES = ["queued", "prefill", "transfer", "decode", "stream"]
TARGETS = ["prefill", "decode", "router"]
FAULTS = ["kill", "stop"]
FAST_CELLS = {("tcp", "kill", "prefill", "prefill"), ("tcp", "kill", "decode", "stream"),
              ("tcp", "stop", "decode", "stream"), ("tcp", "kill", "router", "stream")}
TIMINGS: list[tuple] = []


def start_cluster(tiny_model: str, backend: str) -> PDCluster:
    bootstrap = free_port()
    prefill = prefill_server(tiny_model, backend, bootstrap, *CHAOS_PREFILL)
    decode = decode_server(tiny_model, backend, *CHAOS_DECODE)
    for server in (prefill, decode):
        server.env = {**server.env, **STEP_DELAY}
    front = start_with_router([prefill, decode], lambda: router(
        [(prefill, bootstrap)], [decode], "--max-retries", "0"))
    return PDCluster(backend, prefill, bootstrap, decode, front)


def stop_cluster(cluster: PDCluster) -> None:
    procs = [cluster.router, *cluster.servers]
    for proc in procs:
        proc.signal(signal.SIGCONT)
    stop_all(procs)


@pytest.fixture(scope="module")
def clusters(tiny_model) -> Iterator:
    """One cluster at a time (the cells run backend by backend), started on first use."""
    current: dict[str, PDCluster] = {}

    def get(backend: str) -> PDCluster:
        if backend not in current:
            for other in current.values():
                stop_cluster(other)
            current.clear()
            current[backend] = start_cluster(tiny_model, backend)
        return current[backend]

    yield get
    for cluster in current.values():
        stop_cluster(cluster)
    if TIMINGS:
        print("\nbackend  fault target  phase     victim_end_s  survivors_free_s  recovered_s  cell_s")
        for backend, fault, target, phase, *seconds in TIMINGS:
            print(f"{backend:8} {fault:5} {target:7} {phase:9} " + "  ".join(f"{x:12.2f}" for x in seconds))


@dataclass
class Victim:
    """The request the fault hits: a streamed one (`stream`) or a plain one (`reply`, a future)."""

    stream: Stream | None = None
    reply: object = None

    def failed(self, timeout: float) -> bool:
        if self.stream is not None:
            self.stream.future.result(timeout)
            return self.stream.failed()
        try:
            return self.reply.result(timeout).status != 200
        except OSError:  # the connection broke: an error too
            return True


def generate(cluster: PDCluster, ids: list[int], max_new_tokens: int):
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                  "ignore_eos": True}}
    return POOL.submit(http, "POST", cluster.router.url + "/generate", body, timeout=VICTIM_END_SECONDS)


def router_serves(cluster: PDCluster) -> bool:
    try:
        return generate(cluster, prompt_ids(8, 0), 2).result().status == 200
    except OSError:
        return False


def land(cluster: PDCluster, phase: str) -> Victim:
    """Start the victim and return once it is in `phase`."""
    if phase == "stream":
        stream = Stream(cluster.router.url, {"input_ids": prompt_ids(SHORT_PROMPT, 1), "sampling_params": {
            "temperature": 0, "max_new_tokens": LONG_OUTPUT, "ignore_eos": True}}, VICTIM_END_SECONDS)
        assert stream.first_event.wait(30), "no first streamed token"
        return Victim(stream=stream)
    if phase == "decode":
        victim = Victim(reply=generate(cluster, prompt_ids(SHORT_PROMPT, 2), LONG_OUTPUT))
        wait_until(lambda: holds_pages(cluster.decode) and not holds_pages(cluster.prefill), 30,
                   "the victim decodes")
        return victim
    if phase == "queued":  # queued on the prefill behind a long prompt that is mid-prefill
        generate(cluster, prompt_ids(LONG_PROMPT, 3), 8)
        wait_until(lambda: prefilling(cluster.prefill, 0), 30, "the blocker is mid-prefill")
        victim = Victim(reply=generate(cluster, prompt_ids(LONG_PROMPT, 4), 8))
        wait_until(lambda: scheduler_stats(cluster.prefill)["num_waiting"] > 0, 30, "the victim is queued")
        return victim
    victim = Victim(reply=generate(cluster, prompt_ids(LONG_PROMPT, 5), 8))
    done = 0 if phase == "prefill" else LONG_PROMPT * 3 // 4  # transfer: most of its KV is pushed already
    wait_until(lambda: prefilling(cluster.prefill, done), 30, f"the victim is mid-{phase}")
    return victim


def prefilling(prefill: Proc, done_tokens: int) -> bool:
    """A prompt is mid-prefill on the prefill server, with more than `done_tokens` of its KV computed."""
    stats = scheduler_stats(prefill)
    return stats["num_running"] > 0 and stats["kv_used_tokens"] - stats["kv_cached_tokens"] > done_tokens


def expects_error(fault: str, target: str, phase: str) -> bool | None:
    """True where the fault must fail the victim; None where either ending is right (a frozen process that
    resumes may still finish it); False where the victim no longer needs the target."""
    if target == "prefill" and phase in ("decode", "stream"):
        return False  # its KV is on the decode side already
    return True if fault == "kill" else None


def cells():
    for backend in ("tcp", "mooncake"):
        for fault in FAULTS:
            for target in TARGETS:
                for phase in PHASES:
                    cell = (backend, fault, target, phase)
                    marks = [] if cell in FAST_CELLS else [pytest.mark.chaos_full]
                    yield pytest.param(*cell, marks=marks, id="-".join(cell))


@pytest.mark.parametrize("backend,fault,target,phase", list(cells()))
def test_fault_cell(clusters, backend, fault, target, phase):
    if backend == "mooncake":
        pytest.importorskip("mooncake.engine", reason="pip install mooncake-transfer-engine-non-cuda")
    cluster = clusters(backend)
    started = time.monotonic()
    wait_until(lambda: router_serves(cluster), 30, "the cluster serves before the fault")
    for proc in cluster.servers:
        wait_pool_free(proc, SURVIVOR_FREE_SECONDS)
    victim = land(cluster, phase)
    proc = {"prefill": cluster.prefill, "decode": cluster.decode, "router": cluster.router}[target]
    fault_at = time.monotonic()
    session = proc.proc.pid
    if fault == "kill":
        proc.proc.send_signal(signal.SIGKILL)
    else:
        proc.signal(signal.SIGSTOP)
        time.sleep(FREEZE_SECONDS)
        proc.signal(signal.SIGCONT)
    try:
        failed = victim.failed(VICTIM_END_SECONDS)
        victim_seconds = time.monotonic() - fault_at
        expected = expects_error(fault, target, phase)
        assert expected is None or failed == expected, f"victim failed={failed}, expected {expected}"
        survivors = [s for s in cluster.servers if not (fault == "kill" and s is proc)]
        free_seconds = max(wait_pool_free(s, SURVIVOR_FREE_SECONDS) for s in survivors)
    finally:
        if fault == "kill":  # whatever failed above, the next cell gets a whole cluster
            proc.proc.wait(10)
            wait_until(lambda: not live_session_members(session), 5, f"the killed {target}'s processes exit")
            start_all([proc])
    healthy_at = time.monotonic()
    wait_until(lambda: router_serves(cluster), RECOVERY_SECONDS, "the router serves again")
    recovery_seconds = time.monotonic() - healthy_at
    for server in cluster.servers:
        wait_pool_free(server, SURVIVOR_FREE_SECONDS)
    TIMINGS.append((backend, fault, target, phase, victim_seconds, free_seconds, recovery_seconds,
                    time.monotonic() - started))
