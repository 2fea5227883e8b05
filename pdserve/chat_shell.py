"""The chat shell of `python -m pdserve --shell`: starts the server as a child on a free local port, streams replies
from its /v1/chat/completions route, and stops the server when you leave (/exit, Ctrl-D or Ctrl-C)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from pdserve.config import ServerArgs
from pdserve.ports import free_port

STARTUP_TIMEOUT_SECONDS = 1800.0
SHELL_HELP = "Commands: /reset clears the conversation, /exit quits."


def run_shell(args: ServerArgs, server_argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind through `finally`: stop the server too
    port = free_port()
    log_path = os.path.join(tempfile.gettempdir(), f"pdserve-shell-{os.getpid()}.log")
    command = [sys.executable, "-m", "pdserve.launch_server", *server_argv, "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        print(f"Loading {args.model_name} (server log: {log_path}) ...", flush=True)
        if not _wait_healthy(base_url, server):
            print(f"the server did not start; see {log_path}", file=sys.stderr)
            return 1
        print(f"Ready. {SHELL_HELP}", flush=True)
        _chat_loop(base_url, args)
        return 0
    except KeyboardInterrupt:
        print()
        return 0
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)


def _wait_healthy(base_url: str, server: subprocess.Popen) -> bool:
    deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2):
                return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    return False


def _chat_loop(base_url: str, args: ServerArgs) -> None:
    history: list[dict] = []
    while True:
        try:
            line = input("\n>>> ").strip()
        except EOFError:
            print()
            return
        if line == "/exit":
            return
        if line == "/reset":
            history.clear()
            print("(conversation cleared)")
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        reply = _stream_reply(base_url, args, history)
        if reply is None:
            history.pop()
        else:
            history.append({"role": "assistant", "content": reply})


def _stream_reply(base_url: str, args: ServerArgs, history: list[dict]) -> str | None:
    body = {"model": args.model_name, "messages": history, "stream": True}
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    request = urllib.request.Request(f"{base_url}/v1/chat/completions", json.dumps(body).encode(), headers)
    parts: list[str] = []
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            for raw in response:
                data = raw.decode().strip().removeprefix("data: ")
                if not data or data == "[DONE]":
                    continue
                for choice in json.loads(data).get("choices", []):
                    text = choice.get("delta", {}).get("content") or ""
                    parts.append(text)
                    print(text, end="", flush=True)
    except urllib.error.HTTPError as exc:
        print(f"error: {json.loads(exc.read()).get('error', {}).get('message', exc)}", file=sys.stderr)
        return None
    except (urllib.error.URLError, ConnectionError) as exc:
        print(f"error: the server is unreachable ({exc})", file=sys.stderr)
        return None
    print()
    return "".join(parts)
