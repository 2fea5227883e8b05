"""One server: the scheduler and detokenizer children, and the tokenizer manager and HTTP server in this process.

Children are spawned (never forked), talk over ipc:// sockets in a private temp dir, and are watched:
if one exits, the server logs which one and shuts everything down (no half-alive server). SIGTERM and
SIGINT drain first: new requests get 503 while those in flight get `--shutdown-drain-timeout-s` to finish, the
rest end with an error (in-band on a stream; a second signal ends them at once); then stop the HTTP server,
terminate the children, join them, kill stragglers.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web

from pdserve.detokenizer.process import run_detokenizer_process
from pdserve.process_setup import setup_logging, stop_children
from pdserve.scheduler_main import run_scheduler_process, scheduler_process_name
from pdserve.server.drain import SHUTTING_DOWN, Drain
from pdserve.server.http_server import DRAIN_KEY, create_app
from pdserve.server.metrics import ServerMetrics
from pdserve.server.tokenizer_manager import RequestRejected, TokenizerManager
from pdserve.ports import free_port
from pdserve.tokenizer import load_tokenizer, pack_tokenizer
from pdserve.tqdm_lock import no_process_shared_locks

if TYPE_CHECKING:
    from pdserve.config import ServerArgs

logger = logging.getLogger("pdserve.server")
T = TypeVar("T")

STARTUP_TIMEOUT_SECONDS = 1800.0  # loading a large checkpoint can take many minutes
EXIT_CHILD_DIED = 1
EXIT_START_FAILED = 1
READY_ROLES = {"scheduler", "detokenizer"}  # the leader rank announces once every rank has loaded
FINAL_WRITE_SECONDS = 5.0  # for the requests ended at shutdown to send their error
SPAWN = multiprocessing.get_context("spawn")


def serve(args: ServerArgs) -> int:
    """Run the server until SIGTERM/SIGINT (exit code 0) or a child's death (exit code 1)."""
    setup_logging(args.log_level)
    for note in args.sglang_flag_notes:
        logger.debug("SGLang flag %s", note)
    no_process_shared_locks()
    try:
        _check_port_free(args.host, args.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", args.host, args.port, exc)
        return EXIT_START_FAILED
    ipc_dir = tempfile.mkdtemp(prefix="pdserve-ipc-")  # mode 0700: only this user can reach the sockets
    args = args.replace(ipc_dir=ipc_dir)
    if args.tp_size > 1 and args.nccl_port is None:
        args = args.replace(nccl_port=free_port())
    children: list[BaseProcess] = []  # those started, by `_serve`
    try:
        return asyncio.run(_serve(args, children))
    except (TimeoutError, OSError) as exc:  # a child never became ready; the port is taken
        logger.error("the server could not start: %s", exc)
        return EXIT_START_FAILED
    finally:
        stop_children(children)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _reap(child: BaseProcess, timeout: float = 2.0) -> None:
    """Collect the exit status: the sentinel closes when the child's files do, a moment before it can be reaped."""
    deadline = time.monotonic() + timeout
    while child.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.005)


async def _serve(args: ServerArgs, children: list[BaseProcess]) -> int:
    """Start the children (each added to `children` and watched), load the tokenizer, serve until stopped."""
    loop = asyncio.get_running_loop()
    stop, stop_now = asyncio.Event(), asyncio.Event()
    exit_code = 0

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            logger.warning("received %s again; stopping now", sig.name)
            stop_now.set()
            return
        logger.info("received %s; shutting down", sig.name)
        stop.set()

    def on_child_exit(child: BaseProcess) -> None:
        nonlocal exit_code
        loop.remove_reader(child.sentinel)
        _reap(child)
        logger.error("the %s process (pid %s) exited with code %s; shutting down the server",
                     child.name, child.pid, child.exitcode)
        exit_code = EXIT_CHILD_DIED
        stop.set()

    def start_watched(target: Callable[..., None], name: str, *target_args: Any) -> None:
        child = SPAWN.Process(target=target, args=target_args, name=name)
        child.start()
        children.append(child)
        logger.info("started the %s process (pid %d)", child.name, child.pid)
        loop.add_reader(child.sentinel, on_child_exit, child)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    for rank in range(args.tp_size):
        start_watched(run_scheduler_process, scheduler_process_name(rank), args.replace(tp_rank=rank))
    tm: TokenizerManager | None = None
    runner: web.AppRunner | None = None
    try:
        # Loading the tokenizer imports transformers (seconds); a thread keeps signals and the watchdog live.
        tokenizer = await _unless_stopped(_in_daemon_thread(load_tokenizer, args), stop)
        if stop.is_set():
            return exit_code
        start_watched(run_detokenizer_process, "detokenizer", args, pack_tokenizer(tokenizer))
        tm = TokenizerManager(args, ServerMetrics(args.model_name), tokenizer)
        await _unless_stopped(tm.wait_ready(READY_ROLES, STARTUP_TIMEOUT_SECONDS), stop)
        if stop.is_set():
            return exit_code
        tm.start()
        runner = await _start_http(args, tm)
        await stop.wait()
        if exit_code == 0:
            await _drain(runner.app[DRAIN_KEY], tm, args.shutdown_drain_timeout_s, stop_now)
        return exit_code
    finally:
        for child in children:
            loop.remove_reader(child.sentinel)
        if runner is not None:
            await runner.cleanup()
        if tm is not None:
            tm.close()


async def _drain(drain: Drain, tm: TokenizerManager, timeout_s: float, stop_now: asyncio.Event) -> None:
    """Refuse new requests, give those in flight `timeout_s` (or until `stop_now`), then end the rest."""
    drain.start()
    if drain.in_flight:
        logger.warning("draining %d requests (Ctrl-C again to stop now)", drain.in_flight)
        await _until_idle(drain, timeout_s, stop_now)
    if drain.in_flight:
        logger.warning("ending %d unfinished requests with an error", drain.in_flight)
        tm.end_all(RequestRejected(SHUTTING_DOWN, 503))
        await _until_idle(drain, FINAL_WRITE_SECONDS, asyncio.Event())


async def _until_idle(drain: Drain, timeout_s: float, stop_now: asyncio.Event) -> None:
    """Until no request is in flight, `timeout_s` passed or `stop_now` is set."""
    waits = {asyncio.ensure_future(drain.idle.wait()), asyncio.ensure_future(stop_now.wait())}
    _, pending = await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    for wait in pending:
        wait.cancel()


async def _unless_stopped(awaitable: Awaitable[T], stop: asyncio.Event) -> T | None:
    """The awaitable's result, or None as soon as `stop` is set."""
    task = asyncio.ensure_future(awaitable)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    for pending in (task, stopped):
        if not pending.done():
            pending.cancel()
    return None if stop.is_set() else task.result()


def _in_daemon_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future:
    """Run `fn` in a daemon thread, which (unlike the default executor's) never delays exit."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # handed to the awaiting coroutine
            result, error = None, exc
        loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, daemon=True, name=f"load-{fn.__name__}").start()
    return future


async def _start_http(args: ServerArgs, tm: TokenizerManager) -> web.AppRunner:
    app = create_app(args, tm, tm.metrics)
    access_log = logging.getLogger("aiohttp.access") if args.log_level.lower() == "debug" else None
    runner = web.AppRunner(app, handler_cancellation=True, access_log=access_log)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    logger.info("pdserve is ready: serving %s on http://%s:%d", args.model_name, args.host, args.port)
    return runner


def _check_port_free(host: str, port: int) -> None:
    """Fail in a second, not after the model has loaded, when the HTTP port is taken. SO_REUSEADDR as the HTTP
    server binds it: the sockets a killed server left in TIME_WAIT do not stop a restart on its port."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
