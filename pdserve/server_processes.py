"""pdserve servers and routers as child processes on this machine: their command lines, a start in their own
session with the output in a log file, the wait for /health, and a stop that leaves nothing behind.

`python -m pdserve.launch_cluster`, `scripts/pd_check.py` and the end-to-end tests start their processes here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

HEALTH_POLL_SECONDS = 0.25
HEALTH_REQUEST_TIMEOUT_SECONDS = 2.0
TERMINATE_TIMEOUT_SECONDS = 30.0  # a server itself waits up to 15 s for its scheduler and detokenizer
KILL_TIMEOUT_SECONDS = 10.0
LOG_TAIL_CHARS = 6000


class ClusterError(RuntimeError):
    """Start-up could not finish, or a child died; the message says which child and why."""


def http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def healthy(url: str) -> bool:
    """`url`/health answers 200."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=HEALTH_REQUEST_TIMEOUT_SECONDS) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


def server_argv(model_path: str, port: int, *extra: str, host: str = "127.0.0.1", device: str = "cpu",
                gpu: int | None = None) -> list[str]:
    argv = [sys.executable, "-m", "pdserve.launch_server", "--model-path", model_path, "--host", host,
            "--port", str(port), "--device", device]
    if gpu is not None:
        argv += ["--base-gpu-id", str(gpu)]
    return argv + list(extra)


def prefill_flags(backend: str, bootstrap_port: int) -> list[str]:
    return ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", backend,
            "--disaggregation-bootstrap-port", str(bootstrap_port)]


def decode_flags(backend: str) -> list[str]:
    return ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", backend]


def pd_router_flags(prefills: Sequence[tuple[str, int]], decode_urls: Sequence[str]) -> list[str]:
    """`--prefill`, `--prefill-bootstrap-ports` and `--decode` for (prefill URL, bootstrap port) pairs."""
    return ["--prefill", *(url for url, _ in prefills), "--prefill-bootstrap-ports", *(str(b) for _, b in prefills),
            "--decode", *decode_urls]


def router_argv(port: int, *flags: str, host: str = "127.0.0.1") -> list[str]:
    return [sys.executable, "-m", "pdserve_router", "--host", host, "--port", str(port), *flags]


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the child's whole session (start_new_session: its group id is its pid), grandchildren included."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Proc:
    """One server or router process in its own session; its output goes to `log_path` (a temporary file that
    `stop` deletes when none is given)."""

    name: str
    argv: list[str]
    url: str
    env: dict[str, str] | None = None
    log_path: str = ""
    proc: subprocess.Popen | None = None
    owns_log: bool = False

    def launch(self) -> "Proc":
        if not self.log_path:
            fd, self.log_path = tempfile.mkstemp(prefix=f"pdserve-{self.name.replace(' ', '-')}-", suffix=".log")
            os.close(fd)
            self.owns_log = True
        with open(self.log_path, "w") as log:
            # own session: a Ctrl-C meant for the launcher does not reach it, and a stop reaches its children
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env=self.env)
        return self

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise ClusterError(f"{self.name} (pid {self.proc.pid}) exited with code {code}; "
                               f"end of {self.log_path}:\n{self.log()}")

    def healthy(self) -> bool:
        self.check_alive()
        return healthy(self.url)

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-LOG_TAIL_CHARS:]
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        signal_group(self.proc, sig)

    def terminate(self) -> None:
        """SIGTERM to the process only, as a user would send; a server stops its own children."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def stop(self, timeout: float = TERMINATE_TIMEOUT_SECONDS) -> None:
        """SIGTERM, a wait, then SIGKILL to whatever is left of its session."""
        self.terminate()
        self.wait_or_kill(timeout)

    def wait_or_kill(self, timeout: float) -> None:
        """Wait for the SIGTERM already sent (a second one would end a draining server's requests at once), then
        SIGKILL whatever is left of its session."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            print(f"pdserve: {self.name} did not stop in {timeout:.0f} s; killing it", file=sys.stderr, flush=True)
        self.signal(signal.SIGKILL)
        try:
            self.proc.wait(KILL_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            print(f"pdserve: {self.name} (pid {self.proc.pid}) survived SIGKILL", file=sys.stderr, flush=True)
        if self.owns_log:
            os.unlink(self.log_path)


def wait_healthy(procs: Iterable[Proc], deadline: float, interrupted=lambda: False,
                 on_ready: Callable[[Proc], None] = lambda proc: None) -> None:
    """Until every process answers /health, calling `on_ready` for each as it does; ClusterError when one dies, at
    `deadline` (monotonic) or when `interrupted()` says so."""
    pending = list(procs)
    while pending:
        waiting = []
        for proc in pending:
            if proc.healthy():
                on_ready(proc)
            else:
                waiting.append(proc)
        pending = waiting
        if not pending:
            return
        if interrupted():
            raise ClusterError("interrupted during start-up")
        if time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            raise ClusterError(f"not healthy within the start-up timeout: {names}\n{pending[0].log()}")
        time.sleep(HEALTH_POLL_SECONDS)


def start_all(procs: list[Proc], timeout: float) -> list[Proc]:
    """Launch every process, then wait until all answer /health; on failure stop them all."""
    try:
        for proc in procs:
            proc.launch()
        wait_healthy(procs, time.monotonic() + timeout)
    except BaseException:
        stop_all(procs)
        raise
    return procs


def stop_all(procs: Iterable[Proc], timeout: float = TERMINATE_TIMEOUT_SECONDS) -> None:
    """SIGTERM to all first, so that they stop in parallel, then `stop` each."""
    procs = [p for p in procs if p.proc is not None]
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait_or_kill(timeout)
