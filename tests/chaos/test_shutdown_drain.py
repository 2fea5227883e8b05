"""SIGINT with a stream in flight, on a server, on a router and on `launch_cluster`: new requests get 503 at once,
the stream finishes within the drain time (or, past a short one, ends with an in-band 503 error event), and the
process exits 0 in bounded time, its log naming how many requests it drained and holding no traceback."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from chaos_util import Stream, wait_until
from cluster_util import CHILD_ENV, Proc, free_port, server, start_all, stop_all
from pdserve.scheduler.process import STEP_DELAY_ENV
from pdserve.server_processes import router_argv

pytestmark = pytest.mark.timeout(600)

SLOW_STEPS = {STEP_DELAY_ENV: "0.05"}  # a stream of LONG_OUTPUT tokens lasts seconds
LONG_OUTPUT, ENDLESS_OUTPUT = 60, 400
SHORT_DRAIN = ["--shutdown-drain-timeout-s", "0.5"]
EXIT_SECONDS = 30.0


def slow_server(model: str, name: str, *flags: str) -> Proc:
    proc = server(name, model, *flags)
    proc.env = {**CHILD_ENV, **SLOW_STEPS}
    return proc


def regular_router(worker: Proc, name: str, *flags: str) -> Proc:
    port = free_port()
    argv = router_argv(port, "--worker", worker.url, "--log-level", "warning", "--health-check-interval-s", "0.5",
                       *flags)
    return Proc(name, argv, f"http://127.0.0.1:{port}", env=CHILD_ENV)


def stream(proc: Proc, max_new_tokens: int) -> Stream:
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
    started = Stream(proc.url, body, timeout=120)
    assert started.first_event.wait(60) and not started.failed(), started.events[:1]
    return started


def interrupt_and_check_refusal(proc: Proc) -> None:
    """SIGINT; then, once /health says it drains, a new request gets the standard 503 error."""
    proc.proc.send_signal(signal.SIGINT)
    wait_until(lambda: proc.get("/health").status == 503, 10, f"{proc.name} drains")
    reply = proc.post("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert reply.status == 503, reply.body
    assert "shutting down" in reply.json()["error"]["message"]


def check_completed(drained: Stream) -> None:
    drained.future.result()
    assert not drained.failed(), (drained.status, drained.broken, drained.events[-1:])
    assert len(drained.events[-1]["output_ids"]) == LONG_OUTPUT


def check_ended_in_band(cut: Stream) -> None:
    """The stream's last event is the shutdown's error (the router closes after it, the server sends [DONE])."""
    cut.future.result()
    assert cut.status == 200, cut.status
    assert cut.events[-1]["error"]["code"] == 503, cut.events[-1]


def check_clean_exit(proc: Proc) -> None:
    assert proc.proc.wait(EXIT_SECONDS) == 0, proc.log()
    log = proc.log()
    assert "draining 1 requests (Ctrl-C again to stop now)" in log, log
    assert "Traceback" not in log and "InvalidStateError" not in log, log


def check_drain_and_cut(patient: Proc, hasty: Proc) -> None:
    """A long stream on each, then SIGINT to both: the patient one finishes its stream, the hasty one (a short
    drain) ends its endless stream in-band; both refuse new requests while draining and exit cleanly."""
    drained, cut = stream(patient, LONG_OUTPUT), stream(hasty, ENDLESS_OUTPUT)
    for proc in (patient, hasty):
        interrupt_and_check_refusal(proc)
    check_completed(drained)
    check_ended_in_band(cut)
    for proc in (patient, hasty):
        check_clean_exit(proc)


def test_server_drains_then_ends_the_rest_in_band(tiny_model):
    patient, hasty = slow_server(tiny_model, "server-patient"), slow_server(tiny_model, "server-hasty", *SHORT_DRAIN)
    start_all([patient, hasty])
    try:
        check_drain_and_cut(patient, hasty)
    finally:
        stop_all([patient, hasty])


def test_router_drains_then_ends_the_rest_in_band(tiny_model):
    worker = slow_server(tiny_model, "worker")
    start_all([worker])
    patient, hasty = regular_router(worker, "router-patient"), regular_router(worker, "router-hasty", *SHORT_DRAIN)
    try:
        start_all([patient, hasty])
        check_drain_and_cut(patient, hasty)
    finally:
        stop_all([patient, hasty, worker])


def test_launch_cluster_ctrl_c_drains(tiny_model, tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "pdserve.launch_cluster", "--model-path", tiny_model, "--device", "cpu",
            "--colocated", "--port", str(port), "--log-dir", str(tmp_path), "--", "--max-total-tokens", "4096"]
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**CHILD_ENV, **SLOW_STEPS})
    try:
        for line in launcher.stdout:
            if "Ctrl-C stops everything" in line:
                break
        router = Proc("router", [], f"http://127.0.0.1:{port}")
        drained = stream(router, LONG_OUTPUT)
        launcher.send_signal(signal.SIGINT)
        check_completed(drained)
        output = launcher.communicate(timeout=EXIT_SECONDS)[0]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(30)
    assert launcher.returncode == 0, output
    assert "(Ctrl-C again to stop now)" in output, output
    router_log = (tmp_path / "router.log").read_text()
    assert "draining 1 requests" in router_log and "InvalidStateError" not in router_log, router_log
