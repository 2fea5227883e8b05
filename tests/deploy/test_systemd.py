"""The systemd units: `systemd-analyze verify` accepts them, and their ExecStart commands form a working cluster."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess

import pytest
from deploy_util import INSTALL_BIN, UNITS, unit_settings

from pdserve.cluster_auth import SECRET_ENV

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
UNIT_FILES = sorted(p.name for p in UNITS.iterdir() if p.suffix in (".service", ".target"))
# the README's curl
README_REQUEST = {"text": "请介绍一下你自己", "max_new_tokens": 32, "temperature": 0.7}


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="needs systemd-analyze (Debian's systemd package)")
def test_units_verify_cleanly(tmp_path):
    """Verified inside a root holding the system's own units and the console scripts where the units expect them;
    any warning (unknown key, bad value, missing executable) fails the test."""
    shutil.copytree("/usr/lib/systemd/system", tmp_path / "usr/lib/systemd/system", symlinks=True)
    shutil.copytree(UNITS, tmp_path / "etc/systemd/system", ignore=shutil.ignore_patterns("env"))
    for program in (f"{INSTALL_BIN}pdserve-server", f"{INSTALL_BIN}pdserve-router", "/bin/sh"):  # sh: ExecStartPre
        path = tmp_path / program.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    names = [name.replace("@.", "@0.") for name in UNIT_FILES]
    done = subprocess.run([SYSTEMD_ANALYZE, "verify", "--man=no", f"--root={tmp_path}", *names],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout + done.stderr


def test_units_restart_on_failure_after_the_network_as_a_dedicated_user():
    for name in ("pdserve-prefill@.service", "pdserve-decode@.service", "pdserve-router.service"):
        settings = unit_settings(UNITS / name)
        assert settings["Restart"] == ["on-failure"] and settings["User"] == ["pdserve"], name
        assert "network-online.target" in settings["After"][0].split(), name
        assert settings["NoNewPrivileges"] == ["yes"] and settings["ProtectSystem"] == ["strict"], name
    for name in ("pdserve-prefill@.service", "pdserve-decode@.service"):
        settings = unit_settings(UNITS / name)
        assert settings["LimitMEMLOCK"] == ["infinity"], name  # RDMA registers the KV pool
        assert "PrivateDevices" not in settings, name  # GPUs and /dev/infiniband must stay visible


def received(server) -> float:
    lines = server.get("/metrics").body.decode().splitlines()
    (line,) = [line for line in lines if line.startswith("pdserve_requests_received_total ")]
    return float(line.split()[1])


def test_exec_start_commands_serve_the_readme_request(systemd_cluster):
    router, servers = systemd_cluster.router, (systemd_cluster.prefill, systemd_cluster.decode)
    before = [received(server) for server in servers]
    reply = router.post("/generate", README_REQUEST, timeout=120)
    assert reply.status == 200, reply.body
    answer = reply.json()
    assert isinstance(answer["text"], str) and 1 <= answer["meta_info"]["completion_tokens"] <= 32
    workers = {w["role"]: w for w in router.get("/workers").json()["workers"]}
    assert workers["prefill"]["url"] == systemd_cluster.prefill.url
    assert workers["decode"]["url"] == systemd_cluster.decode.url
    assert [received(server) - b for server, b in zip(servers, before)] == [1, 1]  # both roles took part


@pytest.mark.parametrize("unit", ["pdserve-prefill@.service", "pdserve-decode@.service", "pdserve-router.service"])
def test_units_refuse_to_start_without_the_cluster_secret(unit):
    settings = unit_settings(UNITS / unit)
    assert "/etc/pdserve/secret.env" in settings["EnvironmentFile"]
    (check,) = settings["ExecStartPre"]
    argv = shlex.split(check)
    clean = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    refused = subprocess.run(argv, env={**clean, SECRET_ENV: ""}, capture_output=True, text=True, timeout=10)
    started = subprocess.run(argv, env={**clean, SECRET_ENV: "s"}, capture_output=True, text=True, timeout=10)
    assert refused.returncode != 0 and "secret.env" in refused.stderr and started.returncode == 0
