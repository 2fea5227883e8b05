"""The scheduler process: owns the engine (`Scheduler`) and runs its event loop over ZeroMQ.

One loop iteration = receive what the tokenizer manager sent, dispatch it, run one scheduler step,
send the step's outputs to the detokenizer. A PD server runs this same loop: its role is a part the
`Scheduler` holds (`scheduler/role.py`), which acts at the points the role lists.

With tensor parallelism there is one such process per rank. Rank 0 (the leader) owns the sockets and
broadcasts every message it receives to the other ranks before dispatching it; every rank then runs the
same scheduler on the same messages, so all form the same batches. Only the leader replies or sends outputs.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable

import zmq

from pdserve.engine import compile_watch
from pdserve.ipc import ipc_addr, pull_socket, push_socket
from pdserve.messages import (
    AbortReq,
    BatchTokenOut,
    DecodeSettings,
    FlushCacheReply,
    FlushCacheReq,
    GetStatsReply,
    GetStatsReq,
    MessageError,
    ProcessReady,
    RequestError,
    SwitchRoleReply,
    SwitchRoleReq,
    TokenizedGenerateReq,
    TokenOut,
    decode,
    encode,
)
from pdserve.sampling_params import SamplingParams, SamplingParamsError
from pdserve.scheduler.request import Req

if TYPE_CHECKING:
    from pdserve.config import ServerArgs
    from pdserve.scheduler.scheduler import Scheduler
    from pdserve.scheduler.warmup import WarmupReport

logger = logging.getLogger(__name__)

STEP_DELAY_ENV = "PDSERVE_TEST_STEP_DELAY_S"  # seconds; see SchedulerProcess.step_delay_s


# (scheduler, the server's flags, the role to take) -> the scheduler of that role and None, or the scheduler of the
# old role and why the switch failed (`pdserve/role_switch.py`)
SwitchRole = Callable[["Scheduler", "ServerArgs", str], tuple["Scheduler", "str | None"]]


class SchedulerProcess:
    def __init__(self, args: ServerArgs, scheduler: Scheduler, switch_role: SwitchRole | None = None):
        """`switch_role`: given with `--enable-pd-role-switch`."""
        self.args = args
        self.sched = scheduler
        self.switch_role = switch_role
        self.tp = scheduler.runner.tp
        self.to_detokenizer = self.to_tokenizer = None  # a follower rank sends nothing
        if self.tp.is_leader:
            self._open_sockets(args, scheduler)
        self.handlers: dict[type, Callable[[Any], None]] = {
            TokenizedGenerateReq: self.handle_generate,
            AbortReq: self.handle_abort,
            FlushCacheReq: self.handle_flush_cache,
            GetStatsReq: self.handle_get_stats,
            SwitchRoleReq: self.handle_switch_role,
        }
        # Test-only fault injection (tests/chaos): a pause before every step that has work, so that a request
        # stays in each phase long enough to be hit there. Unset (the default), nothing is slowed.
        self.step_delay_s = float(os.environ.get(STEP_DELAY_ENV) or 0.0)

    def _open_sockets(self, args: ServerArgs, scheduler: Scheduler) -> None:
        self.ctx = zmq.Context()
        self.receiver = pull_socket(self.ctx, ipc_addr(args, "scheduler"), bind=True)
        self.to_detokenizer = push_socket(self.ctx, ipc_addr(args, "detokenizer"))
        self.to_tokenizer = push_socket(self.ctx, ipc_addr(args, "tokenizer"))
        self.poller = zmq.Poller()
        self.poller.register(self.receiver, zmq.POLLIN)
        for fd in scheduler.wakeup_fds():
            self.poller.register(fd, zmq.POLLIN)

    def send(self, sock: zmq.Socket | None, msg: Any) -> None:
        if sock is not None:
            sock.send(encode(msg))

    def announce_ready(self, warmup: WarmupReport | None) -> None:
        self.tp.barrier()  # every rank has loaded its shard and run the same warm-up
        if self.sched.device.type == "cuda":
            compile_watch.arm()  # from now on each Triton compile is one the warm-up missed: counted and logged
        info = {**self.sched.model_info, "warmup": warmup.describe() if warmup else None}
        self.send(self.to_tokenizer, ProcessReady("scheduler", info))

    def run_forever(self, warmup: WarmupReport | None) -> None:
        self.announce_ready(warmup)
        while True:
            for msg in self.recv_requests():
                self.dispatch(msg)
            self.send_outputs(self.run_step())

    def recv_requests(self) -> list[Any]:
        """Everything queued now (on a follower: what the leader received). With nothing to do the leader
        first sleeps until a request or a wake-up (a PD control message) arrives, or `idle_poll_ms` pass so
        that deadlines are checked."""
        raws = self._recv_raw() if self.tp.is_leader else None
        messages = []
        for raw in self.tp.broadcast_messages(raws):
            try:
                messages.append(decode(raw))
            except MessageError as exc:
                logger.error("dropped a malformed message: %s", exc)
        return messages

    def _recv_raw(self) -> list[bytes]:
        if not self.sched.can_step():
            self.poller.poll(self.sched.idle_poll_ms())
        raws = []
        while True:
            try:
                raws.append(self.receiver.recv(zmq.NOBLOCK))
            except zmq.Again:
                return raws

    def dispatch(self, msg: Any) -> None:
        handler = self.handlers.get(type(msg))
        if handler is None:
            logger.error("unexpected message %s", type(msg).__name__)
            return
        handler(msg)

    def handle_generate(self, msg: TokenizedGenerateReq) -> None:
        try:
            req = self.build_req(msg)
            self.sched.add_request(req)
        except (ValueError, TypeError) as exc:  # SamplingParamsError is a ValueError
            self.send(self.to_tokenizer, RequestError(msg.rid, str(exc)))
            return
        settings = DecodeSettings(
            rid=msg.rid,
            skip_special_tokens=req.sampling_params.skip_special_tokens,
            stop=list(req.sampling_params.stop),
            return_logprob=req.return_logprob,
        )
        self.send(self.to_detokenizer, settings)

    def build_req(self, msg: TokenizedGenerateReq) -> Req:
        try:
            params = SamplingParams.from_dict(msg.sampling_params)
        except TypeError as exc:
            raise SamplingParamsError(f"bad sampling parameters: {exc}") from exc
        return Req.of(msg.rid, list(msg.input_ids), params, bootstrap_host=msg.bootstrap_host,
                      bootstrap_port=msg.bootstrap_port, bootstrap_room=msg.bootstrap_room)

    def handle_abort(self, msg: AbortReq) -> None:
        self.sched.abort_request(msg.rid)

    def handle_flush_cache(self, msg: FlushCacheReq) -> None:
        self.send(self.to_tokenizer, FlushCacheReply(msg.request_id, bool(self.sched.flush_cache())))

    def handle_get_stats(self, msg: GetStatsReq) -> None:
        stats = dict(self.sched.stats())
        stats["kv_pool_fully_free"] = not self.sched.has_work() and bool(self.sched.kv_pool_is_fully_free())
        stats["compiles_after_ready"] = compile_watch.compiles_after_ready()
        self.send(self.to_tokenizer, GetStatsReply(msg.request_id, stats))

    def handle_switch_role(self, msg: SwitchRoleReq) -> None:
        """Take the role `msg.mode` on this model runner and KV pool, only when no request, handoff or page is in
        flight; the HTTP side has stopped sending requests and asks again until then or its timeout."""
        busy = self.sched.has_work() or not self.sched.kv_pool_is_fully_free()
        if self.switch_role is None:
            error = "this server was not started with --enable-pd-role-switch"
        elif busy:
            error = "requests, KV handoffs or their pages are still in flight"
        else:
            for fd in self.sched.wakeup_fds():
                self.poller.unregister(fd)
            self.sched, error = self.switch_role(self.sched, self.args, msg.mode)
            for fd in self.sched.wakeup_fds():
                self.poller.register(fd, zmq.POLLIN)
        self.send(self.to_tokenizer, SwitchRoleReply(msg.request_id, error is None, error or "", busy,
                                                     self.sched.model_info))

    def run_step(self) -> list[TokenOut]:
        """One scheduler step; with nothing queued it only handles control messages and deadlines."""
        if self.step_delay_s and self.sched.can_step():
            time.sleep(self.step_delay_s)
        return self.sched.step()

    def send_outputs(self, outputs: list[TokenOut]) -> None:
        if outputs:
            self.send(self.to_detokenizer, BatchTokenOut(outputs))

