"""A PD server that could not serve fails before it loads anything, in one line naming the fix: a mooncake that
does not import or whose engine does not start (run as the README's PD commands run it), nccl without a GPU, and
a server reachable from other hosts without a cluster secret. A loopback bind, a secret, or a colocated server
start as before."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from cluster_util import CHILD_ENV

from pdserve.cluster_auth import SECRET_ENV
from pdserve.config import ConfigError, ServerArgs
from pdserve.preflight import check_before_loading, check_secure_bind, check_transfer_backend
from pdserve.ports import free_port

FAILS_WITHIN_S = 60.0  # a model load is not reached: the failure comes from the checks alone
NO_VERBS = "libibverbs.so.1: cannot open shared object file: No such file or directory"
FAKE_MOONCAKE = {  # mooncake.engine as a broken install has it
    "no_library": f"raise ImportError({NO_VERBS!r})\n",
    "engine_fails": "SUPPORT_CUDA = True\n"
                    "class TransferEngine:\n"
                    "    def initialize(self, *args):\n"
                    "        return -1\n",
}


def start_prefill(model: str, *flags: str, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    argv = [sys.executable, "-m", "pdserve.launch_server", "--model-path", model, "--port", str(free_port()),
            "--device", "cpu", "--disaggregation-mode", "prefill", *flags]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=2 * FAILS_WITHIN_S)
    return done, time.monotonic() - started


def with_fake_mooncake(tmp_path, engine_source: str) -> dict:
    package = tmp_path / "mooncake"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "engine.py").write_text(engine_source)
    return {**CHILD_ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), CHILD_ENV.get("PYTHONPATH", "")])}


@pytest.mark.parametrize("fault, names", [("no_library", NO_VERBS), ("engine_fails", "initialize(")])
def test_a_mooncake_that_cannot_run_fails_in_one_line_before_the_model_loads(tiny_model, tmp_path, fault, names):
    done, took = start_prefill(tiny_model, "--disaggregation-transfer-backend", "mooncake",
                               env=with_fake_mooncake(tmp_path, FAKE_MOONCAKE[fault]))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "mooncake cannot run here" in lines[0] and names in lines[0], lines[0]
    assert "--disaggregation-transfer-backend tcp" in lines[0]
    assert took < FAILS_WITHIN_S and "scheduler" not in done.stdout + done.stderr


def test_a_pd_server_on_every_interface_without_a_secret_does_not_start(tiny_model):
    env = {name: value for name, value in CHILD_ENV.items() if name != SECRET_ENV}
    done, took = start_prefill(tiny_model, "--host", "0.0.0.0", "--disaggregation-transfer-backend", "tcp", env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and SECRET_ENV in lines[0], done.stderr
    assert took < FAILS_WITHIN_S


def pd_args(host: str, **fields) -> ServerArgs:
    return ServerArgs(model_path="m", disaggregation_mode="decode", host=host, **fields)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "192.0.2.10", "2001:db8::1"])
def test_a_bind_other_hosts_reach_needs_a_secret(monkeypatch, host):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ConfigError, match=f"set {SECRET_ENV}.*--disaggregation-secret or --api-key"):
        check_secure_bind(pd_args(host))
    check_secure_bind(pd_args(host, api_key="k"))
    check_secure_bind(pd_args(host, disaggregation_secret="s"))
    monkeypatch.setenv(SECRET_ENV, "s")
    check_secure_bind(pd_args(host))


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_a_loopback_bind_starts_without_a_secret(monkeypatch, host):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    check_secure_bind(pd_args(host))


def test_a_colocated_server_is_not_held_to_the_pd_checks(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    check_before_loading(ServerArgs(model_path="m", host="0.0.0.0", disaggregation_transfer_backend="nccl",
                                    device="cpu"))


def test_nccl_without_a_gpu_fails_naming_tcp():
    with pytest.raises(ConfigError, match="nccl moves the KV cache between GPUs.*--disaggregation-transfer-backend tcp"):
        check_transfer_backend(pd_args("127.0.0.1", disaggregation_transfer_backend="nccl", device="cpu"))
