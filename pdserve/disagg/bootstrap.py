"""The bootstrap server on the prefill side, its blocking client, and the P/D compatibility check.

Routes (aiohttp on its own thread and event loop):
  PUT /route   a prefill rank registers `PrefillRankInfo` as JSON
  GET /route   503 "not ready" until all expected ranks registered, then
               {"model", "tp_size", "transfer_backend", "kv_layout", "ranks": {"0": info, ...}};
               `?rank=N` answers that rank alone (404 if unknown)
  GET /health  200 "OK" (the decode side's heartbeat target)

With a cluster secret, both /route methods need a valid `X-PD-Auth` token (see auth.py) or answer 401: no one
without the secret can register a rank (a route hijack) or read the ranks' endpoints.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, replace

from aiohttp import web

from pdserve.disagg.addressing import is_wildcard, join_endpoint, reachable_endpoint
from pdserve.cluster_auth import HEADER, AuthError, ClusterAuth
from pdserve.distributed.tensor_parallel import kv_heads_per_rank

_LAYOUT_KEYS = ("num_layers", "total_kv_heads", "head_dim", "dtype", "page_size")  # equal on both sides
_SCALE_KEYS = ("k_scales", "v_scales")  # an FP8 layout's per-layer scales: equal on both sides too
_RANK_LAYOUT_KEYS = (*_LAYOUT_KEYS, "num_kv_heads")  # num_kv_heads: the rank's own, which depends on its TP size
_TOPOLOGY_KEYS = ("model", "transfer_backend")


class BootstrapError(RuntimeError):
    """The bootstrap server is unreachable, not ready in time, or answered with an error."""


class IncompatiblePeer(ValueError):
    """Prefill and decode cannot exchange KV; the message names both values."""


@dataclass(frozen=True, slots=True)
class PrefillRankInfo:
    rank: int
    control_endpoint: str  # "ip:port" of the rank's control socket (phase 2 KV manager)
    transfer_session: str  # TransferEngine.session_id()
    transfer_backend: str  # TransferEngine.name
    kv_layout: dict  # KVLayout.describe()
    model: str
    tp_size: int

    @classmethod
    def from_json(cls, data: object) -> "PrefillRankInfo":
        if not isinstance(data, dict):
            raise ValueError("registration must be a JSON object")
        types = {"rank": int, "control_endpoint": str, "transfer_session": str, "transfer_backend": str,
                 "kv_layout": dict, "model": str, "tp_size": int}
        for name, typ in types.items():
            if not isinstance(data.get(name), typ) or isinstance(data.get(name), bool):
                raise ValueError(f"field {name!r} must be {typ.__name__}, got {data.get(name)!r}")
        missing = [k for k in _RANK_LAYOUT_KEYS if k not in data["kv_layout"]]
        if missing:
            raise ValueError(f"kv_layout lacks {', '.join(missing)}")
        return cls(**{name: data[name] for name in types})


class BootstrapServer:
    def __init__(self, host: str, port: int, expected_ranks: int = 1, auth: ClusterAuth | None = None):
        self.expected_ranks = expected_ranks
        self._auth = auth
        self._ranks: dict[int, PrefillRankInfo] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        started = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._run, args=(host, port, started, failure), name="bootstrap-server", daemon=True
        )
        self._thread.start()
        if not started.wait(30) or failure:
            self.close()
            raise BootstrapError(f"bootstrap server could not start on {host}:{port}: {failure[0] if failure else 'timeout'}")

    def _run(self, host: str, port: int, started: threading.Event, failure: list) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start(host, port))
        except BaseException as exc:  # reported to the constructor
            failure.append(exc)
            started.set()
            return
        started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    async def _start(self, host: str, port: int) -> None:
        app = web.Application(client_max_size=1 << 20, middlewares=[self._check_auth] if self._auth else [])
        app.add_routes([web.put("/route", self._put_route), web.get("/route", self._get_route),
                        web.get("/health", self._health)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        self.host, self.port = self._runner.addresses[0][:2]

    @property
    def address(self) -> str:
        return join_endpoint(self.host, self.port)

    @property
    def local_address(self) -> str:
        """The address this host's own processes reach the server at."""
        return join_endpoint("127.0.0.1" if is_wildcard(self.host) else self.host, self.port)

    @web.middleware
    async def _check_auth(self, request: web.Request, handler) -> web.StreamResponse:
        if request.path != "/health":
            try:
                self._auth.verify_token(request.headers.get(HEADER), request.method, request.path_qs,
                                        await request.read())
            except AuthError as exc:
                return web.Response(status=401, text=f"refused: {exc}")
        return await handler(request)

    async def _put_route(self, request: web.Request) -> web.Response:
        try:
            info = PrefillRankInfo.from_json(await request.json())
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            return web.Response(status=400, text=f"bad registration: {exc}")
        if not 0 <= info.rank < self.expected_ranks or info.tp_size != self.expected_ranks:
            return web.Response(status=400, text=f"rank {info.rank} of {info.tp_size} outside "
                                                 f"0..{self.expected_ranks - 1}")
        with self._lock:
            others = [r for r in self._ranks.values() if r.rank != info.rank]
            if others:
                try:
                    check_compatible(describe(others[0]), describe(info), ("rank 0", f"rank {info.rank}"))
                except IncompatiblePeer as exc:
                    return web.Response(status=409, text=str(exc))
            self._ranks[info.rank] = info  # a restarted rank re-registers and replaces its entry
        return web.Response(text="OK")

    async def _get_route(self, request: web.Request) -> web.Response:
        with self._lock:
            ranks = dict(self._ranks)
        if len(ranks) < self.expected_ranks:
            return web.Response(status=503, text=f"not ready: {len(ranks)}/{self.expected_ranks} prefill ranks registered")
        local = request.transport.get_extra_info("sockname")[0]  # the address this lookup reached us at
        ranks = {r: reachable_rank(i, local) for r, i in ranks.items()}
        if "rank" in request.query:
            try:
                info = ranks[int(request.query["rank"])]
            except (ValueError, KeyError):
                return web.Response(status=404, text=f"unknown rank {request.query['rank']!r}")
            return web.json_response(asdict(info))
        first = ranks[0]
        return web.json_response({**describe(first), "ranks": {str(r): asdict(i) for r, i in sorted(ranks.items())}})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)


def reachable_rank(info: PrefillRankInfo, local_address: str) -> PrefillRankInfo:
    """`info` with wildcard hosts replaced by `local_address`, the address the peer asking has reached."""
    return replace(info, control_endpoint=reachable_endpoint(info.control_endpoint, local_address),
                   transfer_session=reachable_endpoint(info.transfer_session, local_address))


def describe(info: PrefillRankInfo) -> dict:
    """The fields both sides must agree on, in the shape `check_compatible` takes."""
    return {"model": info.model, "tp_size": info.tp_size, "transfer_backend": info.transfer_backend,
            "kv_layout": info.kv_layout}


def check_compatible(prefill: dict, decode: dict, sides: tuple[str, str] = ("prefill", "decode")) -> None:
    """Refuse a pair that cannot exchange KV; the message names the value that differs and both layouts. Both
    dicts: {"model", "tp_size", "transfer_backend", "kv_layout": a rank's KVLayout.describe() plus
    "total_kv_heads"}. num_pages may differ, and so may the TP sizes when each side's ranks hold the heads that TP
    size gives them (then every head a decode rank holds is on some prefill rank)."""
    problem = _pairing_problem(prefill, decode, sides)
    if problem:
        a, b = sides
        raise IncompatiblePeer(f"{problem} ({a}: {layout_text(prefill)}; {b}: {layout_text(decode)})")


def _pairing_problem(prefill: dict, decode: dict, sides: tuple[str, str]) -> str | None:
    a, b = sides
    for key in _TOPOLOGY_KEYS:
        if prefill.get(key) != decode.get(key):
            return f"{key} mismatch: {a} has {prefill.get(key)!r}, {b} has {decode.get(key)!r}"
    pl, dl = _layout(prefill), _layout(decode)
    for key in _LAYOUT_KEYS:
        if pl.get(key) != dl.get(key):
            return f"{key} mismatch: {a} has {pl.get(key)}, {b} has {dl.get(key)}"
    for key in _SCALE_KEYS:
        if (problem := scales_problem(key, pl.get(key), dl.get(key), sides)) is not None:
            return problem
    for name, side in ((a, prefill), (b, decode)):
        problem = heads_problem(side)
        if problem:
            return f"{name}'s KV heads do not map to its ranks: {problem}"
    return None


def scales_problem(key: str, prefill: object, decode: object, sides: tuple[str, str]) -> str | None:
    """Why one side's FP8 KV scales `key` are not the other's (None when equal): the first layer that differs, or
    the whole lists when they are not lists of one length. FP8 pages quantized at one scale and read at another
    would decode wrong numbers silently."""
    if prefill == decode:
        return None
    a, b = sides
    if isinstance(prefill, list) and isinstance(decode, list) and len(prefill) == len(decode):
        layer = next(i for i, (p, d) in enumerate(zip(prefill, decode)) if p != d)
        return f"{key} mismatch at layer {layer}: {a} has {prefill[layer]!r}, {b} has {decode[layer]!r}"
    return f"{key} mismatch: {a} has {prefill!r}, {b} has {decode!r}"


def heads_problem(side: dict) -> str | None:
    """Why this side's per-rank KV heads are not what its TP size gives the model's heads (None when they are)."""
    layout, tp = _layout(side), side.get("tp_size")
    total, per_rank = layout.get("total_kv_heads"), layout.get("num_kv_heads")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (tp, total, per_rank)):
        return f"tp_size {tp!r}, total_kv_heads {total!r}, num_kv_heads {per_rank!r} must be positive ints"
    if total % tp and tp % total:
        return f"{total} KV heads cannot be split over or replicated on {tp} ranks"
    if per_rank != kv_heads_per_rank(total, tp):
        return f"{per_rank} KV heads per rank, but TP {tp} of {total} heads gives {kv_heads_per_rank(total, tp)}"
    return None


def layout_text(side: dict) -> str:
    layout = _layout(side)
    return (f"TP {side.get('tp_size')!r} x [{layout.get('num_layers')} layers, {layout.get('num_kv_heads')} of "
            f"{layout.get('total_kv_heads')} KV heads x {layout.get('head_dim')}, {layout.get('dtype')}, "
            f"page {layout.get('page_size')}]")


def _layout(side: dict) -> dict:
    layout = side.get("kv_layout")
    return layout if isinstance(layout, dict) else {}  # a malformed layout then mismatches by name


# ---------------------------------------------------------------------------------------------------
# blocking client


def _request(method: str, url: str, body: dict | None, timeout_s: float,
             auth: ClusterAuth | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        path = "/" + url.split("/", 3)[3]
        headers[HEADER] = auth.token(method, path, data or b"")
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def register_prefill_rank(bootstrap_addr: str, info: PrefillRankInfo, timeout_s: float = 30.0,
                          auth: ClusterAuth | None = None) -> None:
    """PUT /route, retrying while the server is not up yet; a 4xx answer (bad or incompatible) is final."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status, body = _request("PUT", f"http://{bootstrap_addr}/route", asdict(info), timeout_s, auth)
        except OSError as exc:
            status, body = 0, str(exc).encode()
        if status == 200:
            return
        if 400 <= status < 500 or time.monotonic() > deadline:
            raise BootstrapError(f"registering rank {info.rank} at {bootstrap_addr} failed: {status} {body.decode()}")
        time.sleep(0.2)


def fetch_prefill_route(bootstrap_addr: str, timeout_s: float = 30.0, rank: int | None = None,
                        auth: ClusterAuth | None = None) -> dict:
    """GET /route, waiting through 503 "not ready" and connection refusals until `timeout_s`."""
    url = f"http://{bootstrap_addr}/route" + (f"?rank={rank}" if rank is not None else "")
    deadline = time.monotonic() + timeout_s
    answered = None  # the last answer, which says more than a last attempt that timed out
    while True:
        try:
            status, body = _request("GET", url, None, max(deadline - time.monotonic(), 0.1), auth)
            answered = status, body
        except OSError as exc:
            status, body = answered or (0, str(exc).encode())
        if status == 200:
            return json.loads(body)
        if status not in (0, 503) or time.monotonic() > deadline:
            raise BootstrapError(f"GET {url} failed: {status or 'unreachable'} {body.decode(errors='replace')}")
        time.sleep(0.1)


def bootstrap_gone(bootstrap_addr: str, timeout_s: float = 2.0) -> bool:
    """Nothing listens on the bootstrap port any more (a refused connection): the prefill process has exited. A
    frozen process still accepts (the kernel answers for it), so it is never taken for gone."""
    host, _, port = bootstrap_addr.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def bootstrap_healthy(bootstrap_addr: str, timeout_s: float = 2.0) -> bool:
    try:
        return _request("GET", f"http://{bootstrap_addr}/health", None, timeout_s)[0] == 200
    except OSError:
        return False
