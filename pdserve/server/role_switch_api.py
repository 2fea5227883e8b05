"""`POST /pd_role_switch` (`--enable-pd-role-switch`, SGLang's route): a PD server changes role without a restart.

Body: {"new_role": "prefill" | "decode", "drain_timeout_s": 30} (SGLang's field name). The server answers new generation requests 503 (the
router retries them on another instance), waits for those in flight, then asks the scheduler process to switch,
again and again until nothing is in flight there either (KV writes, handoffs, quarantined pages). Once the timeout
has passed the switch is refused (409) and the server goes on serving its old role. The switch itself swaps the
scheduler's role on the same weights and KV pool (`pdserve/role_switch.py`); from then on `/server_info` and `/load`
report the new role. With a cluster secret only the router may ask (its X-PD-Auth token over this request).
"""

from __future__ import annotations

import asyncio
import time
from typing import Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from pdserve.server.drain import Drain
from pdserve.server.http_common import ROLE_SWITCH_PATH, ApiError, json_response, parse_body
from pdserve.server.tokenizer_manager import TokenizerManager

BUSY_RETRY_S = 0.05  # between the scheduler's "still in flight" and the next ask


class RoleSwitchInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    new_role: Literal["prefill", "decode"]
    drain_timeout_s: float = Field(30.0, gt=0, le=3600)


class RoleSwitcher:
    """One switch at a time; a second request meanwhile is refused (409). A switch runs to its end even when its
    client goes away: the HTTP side must learn the role the scheduler took."""

    def __init__(self, tm: TokenizerManager, drain: Drain):
        self.tm, self.drain = tm, drain
        self.running: asyncio.Task | None = None

    async def handle(self, request: web.Request) -> web.Response:
        if not self.tm.args.enable_pd_role_switch:
            raise ApiError(400, "this server was not started with --enable-pd-role-switch")
        body = await parse_body(request, RoleSwitchInput)
        if self.running is not None and not self.running.done():
            raise ApiError(409, "a role switch is already under way")
        self.running = asyncio.ensure_future(self.switch(body.new_role, body.drain_timeout_s))
        self.running.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved if abandoned
        return json_response(await asyncio.shield(self.running))

    async def switch(self, mode: str, timeout_s: float) -> dict:
        old = self.tm.args.disaggregation_mode
        started = time.monotonic()
        if mode != old:
            self.drain.paused = f"this server is switching its role from {old} to {mode}; retry on another instance"
            try:
                await self._switch_when_idle(mode, started + timeout_s)
            finally:
                self.drain.paused = None
        args = self.tm.args
        return {"success": True, "message": "switched" if mode != old else "already in target role",
                "old_role": old, "new_role": mode,
                "bootstrap_port": args.disaggregation_bootstrap_port if mode == "prefill" else None,
                "seconds": round(time.monotonic() - started, 3)}

    async def _switch_when_idle(self, mode: str, deadline: float) -> None:
        try:
            await asyncio.wait_for(self.drain.idle.wait(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise ApiError(409, f"{self.drain.in_flight} requests were still in flight when the drain timeout "
                                "passed; the server keeps its role") from None
        while True:
            reply = await self.tm.switch_role(mode)
            if reply.success:
                return
            if not reply.busy or time.monotonic() >= deadline:
                raise ApiError(409, f"the switch to {mode} was refused ({reply.message}); the server keeps its role")
            await asyncio.sleep(BUSY_RETRY_S)


def add_routes(app: web.Application, switcher: RoleSwitcher) -> None:
    app.router.add_post(ROLE_SWITCH_PATH, switcher.handle)
