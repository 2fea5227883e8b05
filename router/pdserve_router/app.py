"""HTTP routes of the router: generation routes go through the Dispatcher; admin routes fan out or proxy.

`run` serves until SIGTERM or SIGINT, then drains: new generation requests and /health get 503 while those in
flight get `--shutdown-drain-timeout-s` to finish; the rest end with a 503 (in-band on a stream). A second
signal ends them at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
from collections.abc import Iterable

import aiohttp
from aiohttp import web

from .config import DEFAULT_BOOTSTRAP_PORT, ConfigError, RouterConfig
from .dashboard import add_dashboard
from .dispatch import CONNECTION_ERRORS, SHUTTING_DOWN, Dispatcher
from .metrics import CONTENT_TYPE, RouterMetrics
from .payload import BadRequest, error_response, spliceable
from .role_balance import RoleBalancer, RoleSwitcher, SwitchRefused
from .upstream import UpstreamPool
from .workers import CacheReportPoller, HealthChecker, LoadPoller, NoHealthyWorker, Worker, WorkerRegistry

log = logging.getLogger("pdserve_router")
GENERATE_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
MAX_BODY_BYTES = 64 * 1024 * 1024
FINAL_WRITE_SECONDS = 5.0  # for the requests ended at shutdown to send their error


class Router:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.metrics = RouterMetrics()
        self.registry = WorkerRegistry(config)
        for url, port in zip(config.prefill_urls, config.bootstrap_ports):
            self.registry.add(url, "prefill", port)
        for url in config.decode_urls:
            self.registry.add(url, "decode")
        for url in config.worker_urls:
            self.registry.add(url, "regular")
        self.auth = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.session: aiohttp.ClientSession | None = None
        self.upstream: UpstreamPool | None = None
        self.dispatcher: Dispatcher | None = None
        self.health: HealthChecker | None = None
        self.load: LoadPoller | None = None
        self.cache_reports: CacheReportPoller | None = None
        self.role_switcher: RoleSwitcher | None = None
        self.balancer: RoleBalancer | None = None
        self.event_loop = "asyncio"
        self.draining = False

    @property
    def roles(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.config.mode == "pd" else ("regular",)

    async def start(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout)  # health checks, admin, aborts
        self.upstream = UpstreamPool(self.config.connect_timeout_s,  # generation requests
                                     unreachable_timeout_s=self.config.unreachable_timeout_s)
        self.dispatcher = Dispatcher(self.config, self.registry, self.session, self.metrics, self.upstream)
        self.event_loop = loop_name(asyncio.get_running_loop())
        self.health = HealthChecker(self.registry, self.session, self.auth)
        await self.health.check_all()  # one round before the port opens, so /health is right from the start
        self.health.start()
        if self.config.load_poll_roles():  # the local-prefill rule reads the instances' load
            self.load = LoadPoller(self.registry, self.session, self.auth)
            await self.load.check_all()  # loads from the start, like the health checks
            self.load.start()
        if self.config.reported_cache_roles():
            self.cache_reports = CacheReportPoller(self.registry, self.session, self.auth)
            await self.cache_reports.check_all()  # reports from the start, like the health checks
            self.cache_reports.start()
        self.role_switcher = RoleSwitcher(self.config, self.registry, self.session, self.metrics)
        if self.config.balance_roles:
            self.balancer = RoleBalancer(self.config, self.registry, self.session, self.role_switcher)
            self.balancer.start()
        log.info("pdserve-router (%s mode, %s event loop) serving on http://%s:%d with %s", self.config.mode,
                 self.event_loop, self.config.host, self.config.port,
                 ", ".join(f"{w.role} {w.url}" for w in self.registry.workers.values()) or "no instances yet")

    async def stop(self, app: web.Application) -> None:
        await self.health.stop()
        if summary := self.dispatcher.load_rule_summary():
            log.info("%s", summary)
        for poller in (self.load, self.cache_reports, self.balancer):
            if poller is not None:
                await poller.stop()
        await self.dispatcher.close()
        await self.upstream.close()
        await self.session.close()

    async def drain(self, stop_now: asyncio.Event) -> None:
        """Refuse new requests, give those in flight the drain time (or until `stop_now`), then end the rest."""
        self.draining = True
        dispatcher = self.dispatcher
        if dispatcher.in_flight:
            log.warning("draining %d requests (Ctrl-C again to stop now)", len(dispatcher.in_flight))
            await first_of(dispatcher.idle.wait(), stop_now.wait(), within=self.config.shutdown_drain_timeout_s)
        if dispatcher.in_flight:
            log.warning("ending %d unfinished requests with an error", len(dispatcher.in_flight))
            dispatcher.end_all()
            await first_of(dispatcher.idle.wait(), within=FINAL_WRITE_SECONDS)

    # generation

    async def generate(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if self.draining:
            return error_response(503, SHUTTING_DOWN, request.headers.get("X-Request-Id"))
        self.metrics.requests.labels(route=path).inc()
        raw = await request.read()
        charset = request.charset
        try:
            if charset is None or charset.lower() in ("utf-8", "utf8"):
                body = json.loads(raw)  # bytes: UTF-8 (or a UTF-16/32 body, which spliceable() then rejects)
            else:
                body, raw = json.loads(raw.decode(charset)), None
        except (ValueError, LookupError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError;
            # LookupError: an unknown charset; RecursionError: nesting deeper than the parser goes
            self.metrics.errors.labels(kind="bad_request").inc()
            return error_response(400, f"malformed JSON body: {exc}", request.headers.get("X-Request-Id"))
        try:
            if not isinstance(body, dict):
                raise BadRequest("the JSON body must be an object")
            return await self.dispatcher.handle(request, path, body, raw if raw and spliceable(raw) else None)
        except BadRequest as exc:
            self.metrics.errors.labels(kind="bad_request").inc()
            return error_response(400, str(exc), request.headers.get("X-Request-Id"))

    # health and admin

    async def health_route(self, request: web.Request) -> web.Response:
        if self.draining:
            return error_response(503, SHUTTING_DOWN)
        try:
            for role in self.roles:
                if not any(w.ready for w in self.registry.available(role)):
                    raise NoHealthyWorker(f"no {role} instance has passed a health check yet")
        except NoHealthyWorker as exc:
            return error_response(503, str(exc))
        return web.json_response({"status": "ok"})

    async def health_generate(self, request: web.Request) -> web.Response:
        results = await self.fan_out("GET", "/health_generate", self.registry.workers.values())
        ok_roles = {self.registry.workers[url].role for url, r in results.items()
                    if url in self.registry.workers and r["status"] == 200}
        status = 200 if all(role in ok_roles for role in self.roles) else 503
        return web.json_response({"instances": results}, status=status)

    async def flush_cache(self, request: web.Request) -> web.Response:
        results = await self.fan_out("POST", "/flush_cache", self.registry.workers.values())
        status = 200 if all(r["status"] == 200 for r in results.values()) else 502
        return web.json_response({"instances": results}, status=status)

    async def server_info(self, request: web.Request) -> web.Response:
        results = await self.fan_out("GET", "/get_server_info", self.registry.workers.values())
        by_role = {role: [results[w.url].get("body") for w in self.registry.of_role(role) if w.url in results]
                   for role in self.roles}
        internal_states = [state for info in by_role.get("decode", by_role.get("regular", []))
                           if isinstance(info, dict) for state in info.get("internal_states", [])]
        return web.json_response({**by_role, "internal_states": internal_states, "instances": results,
                                  "router": {"mode": self.config.mode, "policies": self.policy_names()}})

    def policy_names(self) -> dict[str, str]:
        return {role: self.config.policy_for(role) for role in self.roles}

    async def proxy_first(self, request: web.Request) -> web.Response:
        """GET routes that any instance answers the same way (model info): the first one that answers wins."""
        workers = sorted(self.registry.workers.values(), key=lambda w: (not w.healthy, w.role != self.roles[0]))
        for worker in workers:
            try:
                async with self.session.get(worker.url + request.path, headers=self.auth,
                                            timeout=aiohttp.ClientTimeout(total=self.config.admin_timeout_s)) as resp:
                    if resp.status < 500:
                        return web.Response(status=resp.status, body=await resp.read(),
                                            content_type=resp.content_type)
            except (*CONNECTION_ERRORS, asyncio.TimeoutError) as exc:
                log.info("%s from %s failed: %s", request.path, worker.url, exc)
        return error_response(503, f"no instance answered {request.path}")

    async def fan_out(self, method: str, path: str, workers: Iterable[Worker]) -> dict[str, dict]:
        workers = list(workers)
        results = await asyncio.gather(*(self.call(method, w.url + path) for w in workers))
        return {w.url: {"role": w.role, **result} for w, result in zip(workers, results)}

    async def call(self, method: str, url: str) -> dict:
        try:
            async with self.session.request(method, url, headers=self.auth,
                                            timeout=aiohttp.ClientTimeout(total=self.config.admin_timeout_s)) as resp:
                raw = await resp.read()
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode(errors="replace")
                return {"status": resp.status, "body": body}
        except (*CONNECTION_ERRORS, asyncio.TimeoutError) as exc:
            return {"status": None, "error": str(exc) or type(exc).__name__}

    async def metrics_route(self, request: web.Request) -> web.Response:
        text = self.metrics.render(self.registry.workers.values())
        return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE,
                                                         "X-Content-Type-Options": "nosniff"})

    # workers

    async def list_workers(self, request: web.Request) -> web.Response:
        return web.json_response({"mode": self.config.mode, "policies": self.policy_names(),
                                  "event_loop": self.event_loop,
                                  "workers": [w.describe() for w in self.registry.workers.values()]})

    async def add_worker(self, request: web.Request) -> web.Response:
        try:
            spec = await json_body(request)
            if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
                raise ConfigError('expected a JSON object {"url": ..., "role": ..., "bootstrap_port": ...}')
            role = spec.get("role", "regular" if self.config.mode == "regular" else None)
            port = spec.get("bootstrap_port", DEFAULT_BOOTSTRAP_PORT)
            if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
                raise ConfigError("bootstrap_port must be an integer in 1..65535")
            worker = self.registry.add(spec["url"], role, port)
        except (ValueError, KeyError) as exc:  # ConfigError and JSON errors are ValueErrors
            return error_response(409 if isinstance(exc, KeyError) else 400, str(exc).strip("'\""))
        worker.healthy = worker.ready = await self.health.probe(worker)
        return web.json_response(worker.describe(), status=201)

    async def pd_role_switch(self, request: web.Request) -> web.Response:
        """`POST /pd_role_switch {"worker_url": ..., "new_role": "prefill" | "decode"}` (SGLang mini_lb's): the
        balance's switch, asked by hand."""
        try:
            spec = await json_body(request)
        except ValueError as exc:
            return error_response(400, str(exc))
        if not isinstance(spec, dict) or not isinstance(spec.get("worker_url"), str) \
                or not isinstance(spec.get("new_role"), str):
            return error_response(400, 'expected a JSON object {"worker_url": ..., "new_role": "prefill" | "decode"}')
        try:
            outcome = await self.role_switcher.switch(spec["worker_url"], spec["new_role"],
                                                      "asked by POST /pd_role_switch")
        except SwitchRefused as exc:
            return error_response(exc.status, str(exc))
        except ConfigError as exc:  # an URL that is not one
            return error_response(400, str(exc))
        return web.json_response(outcome, status=200 if outcome["outcome"] == "switched" else 409)

    async def remove_worker(self, request: web.Request) -> web.Response:
        url = request.query.get("url")
        if url is None and request.body_exists:
            try:
                spec = await json_body(request)
            except ValueError:
                spec = None
            url = spec.get("url") if isinstance(spec, dict) else None
        if not isinstance(url, str):
            return error_response(400, 'give the worker as ?url=... or a JSON body {"url": ...}')
        try:
            worker = self.registry.remove(url)
        except (KeyError, ConfigError):
            return error_response(404, f"no worker {url}")
        self.upstream.forget(worker.url)
        return web.json_response(worker.describe())


ROUTER = web.AppKey("router", Router)


async def json_body(request: web.Request) -> object:
    """The parsed body of an admin request; any malformed body (nesting too deep included) is a ValueError."""
    try:
        return await request.json()
    except RecursionError as exc:
        raise ValueError("malformed JSON body: nested too deeply") from exc


@web.middleware
async def json_errors_middleware(request: web.Request, handler):
    """Every error the router answers itself is JSON: unknown routes and methods, oversized bodies, its own bugs."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason, request.headers.get("X-Request-Id"))
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(500, "internal router error", request.headers.get("X-Request-Id"))


@web.middleware
async def body_timeout_middleware(request: web.Request, handler):
    """A body slower than --request-body-timeout-s is cut: 408 and the connection closed, so a client that sends
    headers and stalls holds nothing."""
    seconds = request.app[ROUTER].config.request_body_timeout_s
    try:
        await asyncio.wait_for(request.read(), seconds)  # aiohttp keeps the body for the handler
    except asyncio.TimeoutError:
        stalled = error_response(408, f"the request body did not arrive within {seconds:g} s",
                                 request.headers.get("X-Request-Id"))
        stalled.force_close()
        return stalled
    return await handler(request)


@web.middleware
async def auth_middleware(request: web.Request, handler):
    key = request.app[ROUTER].config.api_key
    if key and request.path != "/health":
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return error_response(401, "missing or wrong API key")
    return await handler(request)


def create_app(config: RouterConfig) -> web.Application:
    router = Router(config)
    middlewares = [json_errors_middleware, body_timeout_middleware, *([auth_middleware] if config.api_key else [])]
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[ROUTER] = router
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    for path in GENERATE_ROUTES:
        app.router.add_post(path, router.generate)
    app.router.add_get("/health", router.health_route)
    app.router.add_get("/health_generate", router.health_generate)
    app.router.add_route("*", "/flush_cache", router.flush_cache)
    for prefix in ("/get_", "/"):  # SGLang serves both spellings
        app.router.add_get(f"{prefix}server_info", router.server_info)
        app.router.add_get(f"{prefix}model_info", router.proxy_first)
    app.router.add_get("/v1/models", router.proxy_first)
    app.router.add_get("/metrics", router.metrics_route)
    app.router.add_get("/workers", router.list_workers)
    app.router.add_post("/workers", router.add_worker)
    app.router.add_delete("/workers", router.remove_worker)
    app.router.add_post("/pd_role_switch", router.pd_role_switch)
    add_dashboard(app, router.registry, router.config, router.policy_names)
    return app


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    return "uvloop" if type(loop).__module__.partition(".")[0] == "uvloop" else "asyncio"


def new_event_loop(choice: str) -> asyncio.AbstractEventLoop:
    """`--event-loop`: uvloop (the `fast` extra) when importable and not turned off, else asyncio's own loop."""
    if choice in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise ConfigError("--event-loop uvloop: uvloop is not installed "
                                  "(pip install 'pdserve-router[fast]')") from None
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


async def first_of(*waits, within: float) -> None:
    """Until the first of the awaitables `waits` completes, or `within` seconds; the others are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    await asyncio.wait(tasks, timeout=within, return_when=asyncio.FIRST_COMPLETED)
    for task in tasks:
        task.cancel()


async def serve(config: RouterConfig) -> None:
    """Serve until SIGTERM or SIGINT, drain, stop."""
    app = create_app(config)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    stop, stop_now = asyncio.Event(), asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        log.info("received %s; %s", sig.name, "stopping now" if stop.is_set() else "shutting down")
        (stop_now if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await web.TCPSite(runner, config.host, config.port).start()
        await stop.wait()
        await app[ROUTER].drain(stop_now)
    finally:
        await runner.cleanup()


def run(config: RouterConfig) -> None:
    loop = new_event_loop(config.event_loop)
    try:
        loop.run_until_complete(serve(config))
    finally:
        loop.close()
