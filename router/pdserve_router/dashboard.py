"""GET /dashboard: the cluster's status page (plain HTML and a small script, no build step), which polls
GET /dashboard/status (JSON): every instance with its health, breaker and requests in flight, the (prefill,
decode) pairs the router can form now, and the router's recent warnings and errors."""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable

from aiohttp import web

from .config import RouterConfig
from .workers import WorkerRegistry

RECENT_ERRORS = 50
POLL_INTERVAL_MS = 2000


class RecentErrors(logging.Handler):
    """Keeps the router's last warnings and errors (failed attempts, instances out of rotation) for the page."""

    def __init__(self, capacity: int = RECENT_ERRORS):
        super().__init__(logging.WARNING)
        self.entries: deque[dict] = deque(maxlen=capacity)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):
            self.handleError(record)
            return
        self.entries.append({"time": record.created, "level": record.levelname, "message": message})

    def newest_first(self) -> list[dict]:
        return list(reversed(self.entries))


class Dashboard:
    def __init__(self, registry: WorkerRegistry, config: RouterConfig, policy_names: Callable[[], dict[str, str]]):
        self.registry = registry
        self.config = config
        self.policy_names = policy_names
        self.errors = RecentErrors()
        self.logger = logging.getLogger("pdserve_router")

    async def attach(self, app: web.Application) -> None:
        self.logger.addHandler(self.errors)

    async def detach(self, app: web.Application) -> None:
        self.logger.removeHandler(self.errors)

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})

    async def status(self, request: web.Request) -> web.Response:
        workers = list(self.registry.workers.values())
        instances = [{**w.describe(), "in_rotation": w.in_rotation} for w in workers]
        in_rotation = {i["url"]: i["in_rotation"] for i in instances}
        prefills = [w.url for w in workers if w.role == "prefill" and in_rotation[w.url]]
        decodes = [w.url for w in workers if w.role == "decode" and in_rotation[w.url]]
        pairs = [{"prefill": p, "decode": d} for p, d in itertools.product(prefills, decodes)]
        return web.json_response({"mode": self.config.mode, "policies": self.policy_names(),
                                  "time": time.time(), "instances": instances, "pairs": pairs,
                                  "recent_errors": self.errors.newest_first()},
                                 headers={"Cache-Control": "no-cache"})


def add_dashboard(app: web.Application, registry: WorkerRegistry, config: RouterConfig,
                  policy_names: Callable[[], dict[str, str]]) -> None:
    dashboard = Dashboard(registry, config, policy_names)
    app.on_startup.insert(0, dashboard.attach)  # before the router's first health-check round, which may warn
    app.on_cleanup.append(dashboard.detach)
    app.router.add_get("/dashboard", dashboard.page)
    app.router.add_get("/dashboard/status", dashboard.status)


PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>pdserve cluster</title>
<style>
  body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
  h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.5em; }
  table { border-collapse: collapse; } th, td { border: 1px solid #ccc; padding: 0.3em 0.7em; text-align: left; }
  th { background: #f3f3f3; } td.num { text-align: right; }
  .up { color: #17772b; font-weight: 600; } .down { color: #b3261e; font-weight: 600; }
  #state.stale { color: #b3261e; } .muted { color: #777; }
</style>
</head>
<body>
<h1>pdserve cluster</h1>
<p id="state" class="muted">loading...</p>
<h2>Instances</h2>
<table id="instances">
  <thead><tr><th>role</th><th>url</th><th>health</th><th>circuit</th><th>in flight</th><th>bootstrap port</th></tr></thead>
  <tbody></tbody>
</table>
<h2>Pairs the router can form now (<span id="pair-count">0</span>)</h2>
<table id="pairs"><thead><tr><th>prefill</th><th>decode</th></tr></thead><tbody></tbody></table>
<h2>Recent warnings and errors</h2>
<table id="errors"><thead><tr><th>time</th><th>level</th><th>message</th></tr></thead><tbody></tbody></table>
<script>
"use strict";
const POLL_MS = %(poll)d;

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
}

function fill(tableId, items, render) {
  const body = document.querySelector("#" + tableId + " tbody");
  body.replaceChildren();
  for (const item of items) render(body.insertRow(), item);
}

function show(status) {
  const state = document.getElementById("state");
  state.className = "muted";
  const policies = Object.entries(status.policies).map(([role, policy]) => role + " " + policy).join(", ");
  state.textContent = status.mode + " mode; policies: " + policies +
    "; updated " + new Date(status.time * 1000).toLocaleTimeString();
  fill("instances", status.instances, (row, w) => {
    row.dataset.url = w.url;
    cell(row, w.role);
    cell(row, w.url);
    cell(row, w.in_rotation ? "in rotation" : (w.ready ? "out of rotation" : "not ready"),
         w.in_rotation ? "up" : "down");
    cell(row, w.circuit);
    cell(row, String(w.in_flight), "num");
    cell(row, w.bootstrap_port === null ? "" : String(w.bootstrap_port), "num");
  });
  document.getElementById("pair-count").textContent = String(status.pairs.length);
  fill("pairs", status.pairs, (row, p) => { cell(row, p.prefill); cell(row, p.decode); });
  fill("errors", status.recent_errors, (row, e) => {
    cell(row, new Date(e.time * 1000).toLocaleTimeString());
    cell(row, e.level);
    cell(row, e.message);
  });
}

async function poll() {
  try {
    const reply = await fetch("dashboard/status", {cache: "no-store"});
    if (!reply.ok) throw new Error("HTTP " + reply.status);
    show(await reply.json());
  } catch (err) {
    const state = document.getElementById("state");
    state.className = "stale";
    state.textContent = "router unreachable (" + err.message + "); retrying";
  }
  setTimeout(poll, POLL_MS);
}
poll();
</script>
</body>
</html>
""" % {"poll": POLL_INTERVAL_MS}
