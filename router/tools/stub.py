"""Stub pdserve servers (prefill, decode or regular) for the router's tests and benchmark.

They speak the pdserve HTTP contract without a model: a decode stub waits until the prefill stub of the same
`bootstrap_room` has "sent the KV" (a shared in-process Fabric) or until its request is aborted, then streams
`tokens` SSE events. Faults are knobs on StubServer: `fail_status`, `healthy`, `delay_s`, `response_delay_s`.
`POST /pd_role_switch` changes a PD stub's role (or answers `switch_status` when that is not 200).

`python -m tools.stub --prefill-ports 31000 --decode-ports 31001` serves them in one process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class Fabric:
    """Stands in for the KV transfer: prefill marks a room ready, decode waits for it."""

    def __init__(self) -> None:
        self.rooms: dict[int, asyncio.Event] = {}

    def event(self, room: int) -> asyncio.Event:
        return self.rooms.setdefault(room, asyncio.Event())

    def mark_ready(self, rooms: list[int]) -> None:
        for room in rooms:
            self.event(room).set()

    async def wait_ready(self, rooms: list[int]) -> None:
        try:
            await asyncio.gather(*(self.event(room).wait() for room in rooms))
        finally:
            for room in rooms:
                self.rooms.pop(room, None)


@dataclass
class StubServer:
    role: str
    fabric: Fabric
    port: int = 0
    name: str = ""
    tokens: int = 4
    token_interval_s: float = 0.0
    delay_s: float = 0.0
    response_delay_s: float = 0.0
    wait_timeout_s: float = 10.0
    couple: bool = True
    event_pad: int = 0  # bytes of filler in each streamed event (large streams for flow-control tests)
    fail_status: int | None = None
    healthy: bool = True
    held: bool = False  # generate requests wait until release() while held
    load: dict | None = None  # what GET /load answers (queued tokens, rates, KV usage: docs/pd.md); None: 404
    bootstrap_port: int = 8998  # what /get_server_info reports (a prefill's, or a decode's once it switches)
    switch_status: int = 200  # the answer to POST /pd_role_switch; 200 switches the role
    switches: list[str] = field(default_factory=list)  # the roles POST /pd_role_switch asked for
    text_bytes_per_token: float = 4.0  # the stub's "tokenizer": /generate answers report text prompts this long
    requests: list[dict] = field(default_factory=list)
    aborted: list[Any] = field(default_factory=list)
    abort_events: dict[str, asyncio.Event] = field(default_factory=dict)
    in_flight: int = 0
    max_in_flight: int = 0
    runner: web.AppRunner | None = None
    released: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> web.Application:
        app = web.Application()
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, self.generate)
        app.router.add_post("/abort_request", self.abort)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/flush_cache", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/load", self.load_report)
        app.router.add_post("/pd_role_switch", self.switch_role)
        return app

    async def start(self) -> None:
        self.released = asyncio.Event()
        if not self.held:
            self.released.set()
        self.runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self.runner.addresses[-1][1]
        self.name = self.name or f"{self.role}:{self.port}"

    def release(self) -> None:
        self.held = False
        self.released.set()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": self.healthy}, status=200 if self.healthy else 503)

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"role": self.role, "name": self.name, "internal_states": [{"name": self.name}],
                                  "disaggregation_mode": self.role,
                                  "disaggregation_bootstrap_port": self.bootstrap_port})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "stub-model", "served_by": self.name})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=f"stub_requests_total {len(self.requests)}\n")

    async def load_report(self, request: web.Request) -> web.Response:
        return web.json_response(self.load) if self.load is not None else web.json_response({}, status=404)

    async def switch_role(self, request: web.Request) -> web.Response:
        role = (await request.json())["new_role"]
        self.switches.append(role)
        if self.switch_status != 200:
            return web.json_response({"error": {"message": "stub refuses the switch"}}, status=self.switch_status)
        self.role = role
        if self.load is not None:
            self.load = {**self.load, "disaggregation_mode": role}
        return web.json_response({"success": True, "new_role": role, "bootstrap_port": self.bootstrap_port})

    async def abort(self, request: web.Request) -> web.Response:
        rid = (await request.json()).get("rid")
        self.aborted.append(rid)
        for one in rid if isinstance(rid, list) else [rid]:
            self.abort_events.setdefault(one, asyncio.Event()).set()
        return web.json_response({"ok": True})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.requests.append({"path": request.path, "body": body, "headers": headers})
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self.released.wait()
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.fail_status is not None:
                message = f"stub {self.name} fails on purpose"
                error = {"message": message, "type": "StubError", "code": self.fail_status}
                return web.json_response({"error": error}, status=self.fail_status)
            rooms = body.get("bootstrap_room")
            rooms = rooms if isinstance(rooms, list) else [] if rooms is None else [rooms]
            if self.role == "prefill":
                self.fabric.mark_ready(rooms)
                await asyncio.sleep(self.response_delay_s)
                return await self.answer(request, body, 1, "stop")
            aborted = self.role == "decode" and self.couple and rooms and not await self.wait_for_kv(body, rooms)
            if aborted:
                return await self.answer(request, body, 0, "abort")
            return await self.answer(request, body, self.max_tokens(body), "length")
        finally:
            self.in_flight -= 1

    def max_tokens(self, body: dict) -> int:
        """`sampling_params.max_new_tokens` (or OpenAI `max_tokens`) when given, else the stub's `tokens`."""
        params = body.get("sampling_params")
        wanted = params.get("max_new_tokens") if isinstance(params, dict) else body.get("max_tokens")
        return wanted if isinstance(wanted, int) and 0 < wanted <= 4096 else self.tokens

    async def wait_for_kv(self, body: dict, rooms: list[int]) -> bool:
        """True once every room's KV is ready; False when the request is aborted or times out first."""
        rid = body.get("rid") or ""
        rids = rid if isinstance(rid, list) else [rid]
        abort_event = self.abort_events.setdefault(rids[0], asyncio.Event())
        ready = asyncio.ensure_future(self.fabric.wait_ready(rooms))
        aborted = asyncio.ensure_future(abort_event.wait())
        try:
            await asyncio.wait((ready, aborted), timeout=self.wait_timeout_s, return_when=asyncio.FIRST_COMPLETED)
            return ready.done() and not aborted.done()
        finally:
            ready.cancel()
            aborted.cancel()
            self.abort_events.pop(rids[0], None)

    async def answer(self, request: web.Request, body: dict, tokens: int, finish: str) -> web.StreamResponse:
        items = self.batch_items(request.path, body)
        if not body.get("stream"):
            results = [self.item(request.path, body, i, "".join(f"t{k} " for k in range(tokens)), finish, tokens)
                       for i in range(items)]
            return web.json_response(results if self.is_batch(request.path, body) else results[0])
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        for k in range(tokens):
            if k and self.token_interval_s:
                await asyncio.sleep(self.token_interval_s)
            for i in range(items):
                last = finish if k == tokens - 1 else None
                await self.send(response, self.item(request.path, body, i, f"t{k} ", last, k + 1))
        if tokens == 0:
            for i in range(items):
                await self.send(response, self.item(request.path, body, i, "", finish, 0))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    @staticmethod
    async def send(response: web.StreamResponse, payload: dict) -> None:
        await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    @staticmethod
    def is_batch(path: str, body: dict) -> bool:
        return path == "/generate" and (isinstance(body.get("text"), list) or
                                        bool(body.get("input_ids")) and isinstance(body["input_ids"][0], list))

    def batch_items(self, path: str, body: dict) -> int:
        if self.is_batch(path, body):
            return len(body.get("text") or body.get("input_ids"))
        return 1

    def prompt_tokens(self, path: str, body: dict, index: int) -> int:
        prompt = body.get("text", body.get("input_ids")) or ""
        if self.is_batch(path, body):
            prompt = prompt[index]
        return math.ceil(len(prompt.encode("utf-8", "surrogatepass")) / self.text_bytes_per_token) if isinstance(prompt, str) else len(prompt)

    def item(self, path: str, body: dict, index: int, text: str, finish: str | None, completion_tokens: int) -> dict:
        if path == "/v1/chat/completions":
            key = "delta" if body.get("stream") else "message"
            choice = {"index": index, key: {"role": "assistant", "content": text}, "finish_reason": finish}
            return {"id": "chatcmpl-stub", "object": "chat.completion", "served_by": self.name, "choices": [choice]}
        if path == "/v1/completions":
            choice = {"index": index, "text": text, "finish_reason": finish}
            return {"id": "cmpl-stub", "object": "text_completion", "served_by": self.name, "choices": [choice]}
        meta: dict[str, Any] = {"id": body.get("rid"), "prompt_tokens": self.prompt_tokens(path, body, index),
                                "completion_tokens": completion_tokens,
                                "finish_reason": {"type": finish} if finish else None}
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = ([[-0.5, t, None] for t in range(3)] if self.role == "prefill" else [])
            meta["output_token_logprobs"] = [[-0.1, 7, None]] * completion_tokens
        item = {"text": text, "index": index, "served_by": self.name, "meta_info": meta}
        if self.event_pad and body.get("stream"):
            item["pad"] = "x" * self.event_pad
        return item


class StubHost:
    """Runs stub servers on an event loop in a background thread (for synchronous tests)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.fabric = Fabric()
        self.servers: list[StubServer] = []

    def call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def add(self, role: str, **knobs: Any) -> StubServer:
        server = StubServer(role, self.fabric, **knobs)
        self.call(server.start())
        self.servers.append(server)
        return server

    def stop(self, server: StubServer) -> None:
        self.call(server.stop())

    def release(self, server: StubServer) -> None:
        self.loop.call_soon_threadsafe(server.release)

    def restart(self, server: StubServer) -> None:
        self.call(server.start())

    def close(self) -> None:
        for server in self.servers:
            self.call(server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


async def serve(roles_ports: list[tuple[str, int]], **knobs: Any) -> None:
    fabric = Fabric()
    servers = [StubServer(role, fabric, port=port, **knobs) for role, port in roles_ports]
    for server in servers:
        await server.start()
    print("stubs ready: " + " ".join(f"{s.role}={s.url}" for s in servers), flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for role in ("prefill", "decode", "regular"):
        parser.add_argument(f"--{role}-ports", nargs="*", type=int, default=[])
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--token-interval-s", type=float, default=0.0)
    parser.add_argument("--no-couple", action="store_true", help="decode does not wait for the prefill's room")
    args = parser.parse_args()
    roles_ports = [(role, port) for role in ("prefill", "decode", "regular") for port in getattr(args, f"{role}_ports")]
    asyncio.run(serve(roles_ports, tokens=args.tokens, token_interval_s=args.token_interval_s,
                      couple=not args.no_couple))


if __name__ == "__main__":
    main()
