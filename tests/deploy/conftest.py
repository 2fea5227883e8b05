"""The cluster the systemd units describe: their `ExecStart` lines, expanded as systemd expands them from the shipped
example env files (filled in for loopback and a tiny CPU model), run as real processes. The Prometheus and Grafana
tests scrape and query this same cluster."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster_util import CONTEXT_LENGTH, MAX_TOTAL_TOKENS, free_port, release_after_last_user, start_all, stop_all
from deploy_util import DECODE_GPU, PREFILL_GPU, SystemdCluster, fill_env_files, unit_process

from pdserve.tools.make_model import make_model


@pytest.fixture(scope="session")
def systemd_cluster(request, tmp_path_factory) -> Iterator[SystemdCluster]:
    model = make_model("qwen3-tiny", tmp_path_factory.mktemp("models") / "qwen3-tiny", seed=0)
    env_dir = tmp_path_factory.mktemp("etc-pdserve")
    prefill_port, bootstrap_port, decode_port, router_port = (free_port() for _ in range(4))
    fill_env_files(env_dir, {
        "pdserve.env": {"PDSERVE_MODEL": str(model), "PDSERVE_HOST": "127.0.0.1", "PDSERVE_TRANSFER_BACKEND": "tcp",
                        "PDSERVE_EXTRA_ARGS": f"--device cpu --max-total-tokens {MAX_TOTAL_TOKENS} "
                                              f"--context-length {CONTEXT_LENGTH}"},
        f"prefill-{PREFILL_GPU}.env": {"PDSERVE_PORT": str(prefill_port), "PDSERVE_BOOTSTRAP_PORT": str(bootstrap_port)},
        f"decode-{DECODE_GPU}.env": {"PDSERVE_PORT": str(decode_port)},
        "router.env": {"PDSERVE_ROUTER_HOST": "127.0.0.1", "PDSERVE_ROUTER_PORT": str(router_port),
                       "PDSERVE_ROUTER_ARGS": f"--prefill http://127.0.0.1:{prefill_port} --prefill-bootstrap-ports "
                                              f"{bootstrap_port} --decode http://127.0.0.1:{decode_port} "
                                              "--health-check-interval-s 0.5"},
        "secret.env": {"PDSERVE_DISAGGREGATION_SECRET": "systemd-test-secret"},
    })
    cluster = SystemdCluster(
        router=unit_process("router", "pdserve-router.service", "", env_dir, f"http://127.0.0.1:{router_port}"),
        prefill=unit_process("prefill", "pdserve-prefill@.service", PREFILL_GPU, env_dir,
                             f"http://127.0.0.1:{prefill_port}"),
        decode=unit_process("decode", "pdserve-decode@.service", DECODE_GPU, env_dir,
                            f"http://127.0.0.1:{decode_port}"))
    procs = start_all([cluster.prefill, cluster.decode, cluster.router])
    stop = release_after_last_user(request, lambda: stop_all(procs))  # after the last test that scrapes it
    try:
        yield cluster
    finally:
        stop()

