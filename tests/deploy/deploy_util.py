"""Reading the deploy/ files as their tools do: systemd unit settings, EnvironmentFile contents and ExecStart
expansion; the cluster those commands form."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from cluster_util import Proc

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNITS = DEPLOY / "systemd"
INSTALL_BIN = "/opt/pdserve/venv/bin/"  # where the units expect the console scripts
PREFILL_GPU, DECODE_GPU = "0", "1"  # the instances the example env files are written for
VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
LONE_VARIABLE = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")


def unit_settings(path: Path) -> dict[str, list[str]]:
    """Every `Key=value` of a unit file, by key, in order (a key such as EnvironmentFile may repeat)."""
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def read_env_file(path: Path) -> dict[str, str]:
    """systemd's EnvironmentFile format as the shipped files use it: KEY=VALUE lines and # comments."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";")):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
            env[key.strip()] = value.strip()
    return env


def write_env_file(path: Path, env: dict[str, str]) -> None:
    path.write_text("".join(f"{key}={value}\n" for key, value in env.items()))


def expand_command(line: str, instance: str, env: dict[str, str]) -> list[str]:
    """An ExecStart line as systemd runs it: %i is the instance, "${VAR}" one word with the exact value, a lone
    "$VAR" word the value split at whitespace (zero or more words), an unset variable empty."""
    argv: list[str] = []
    for word in shlex.split(line.replace("%i", instance)):
        lone = LONE_VARIABLE.fullmatch(word)
        if lone:
            argv += env.get(lone[1], "").split()
        else:
            argv.append(VARIABLE.sub(lambda m: env.get(m[1], ""), word))
    return argv


def installed_script(path: str) -> str:
    """The unit's /opt/pdserve/venv/bin/<script> is this environment's console script of the same name."""
    assert path.startswith(INSTALL_BIN), path
    name = path[len(INSTALL_BIN):]
    beside_python = Path(sys.executable).with_name(name)
    found = str(beside_python) if beside_python.exists() else shutil.which(name)
    assert found, f"console script {name} is not installed (pip install -e . -e ./router)"
    return found


def unit_environment(unit: str, instance: str, env_dir: Path) -> dict[str, str]:
    """The variables the unit's EnvironmentFile lines load (from `env_dir`)."""
    env: dict[str, str] = {}
    for env_file in unit_settings(UNITS / unit)["EnvironmentFile"]:
        path = Path(env_file.replace("%i", instance))
        assert path.parent == Path("/etc/pdserve"), env_file
        env.update(read_env_file(env_dir / path.name))
    return env


def unit_command(unit: str, instance: str, env_dir: Path) -> list[str]:
    """The unit's ExecStart, expanded with its environment."""
    (exec_start,) = unit_settings(UNITS / unit)["ExecStart"]
    argv = expand_command(exec_start, instance, unit_environment(unit, instance, env_dir))
    return [installed_script(argv[0]), *argv[1:]]


def unit_process(name: str, unit: str, instance: str, env_dir: Path, url: str) -> Proc:
    """The unit's ExecStart as a process with the unit's environment, as systemd starts it."""
    env = {**os.environ, **unit_environment(unit, instance, env_dir)}
    return Proc(name, unit_command(unit, instance, env_dir), url, env=env)


def fill_env_files(env_dir: Path, values: dict[str, dict[str, str]]) -> None:
    """The shipped example env files with `values` (file name -> key -> value) put in; every key must exist in the
    example, so that the test and the examples cannot drift apart."""
    for path in sorted((UNITS / "env").glob("*.env")):
        env = read_env_file(path)
        overrides = values.get(path.name, {})
        missing = set(overrides) - set(env)
        assert not missing, f"{path.name} has no {sorted(missing)}"
        write_env_file(env_dir / path.name, {**env, **overrides})


@dataclass(frozen=True, slots=True)
class SystemdCluster:
    router: Proc
    prefill: Proc
    decode: Proc

    @property
    def jobs(self) -> dict[str, Proc]:
        """The Prometheus job that scrapes each process."""
        return {"pdserve-router": self.router, "pdserve-prefill": self.prefill, "pdserve-decode": self.decode}
