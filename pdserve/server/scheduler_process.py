"""The scheduler process: owns the engine (`Scheduler`) and runs its event loop over ZeroMQ.

One loop iteration = receive what the tokenizer manager sent, dispatch it, run one scheduler step,
send the step's outputs to the detokenizer. Each part is its own method so the PD roles can extend
the loop (e.g. `handle_generate` to enqueue into a bootstrap queue, `run_step` to poll KV transfers).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable

import zmq

from pdserve.sampling_params import SamplingParams, SamplingParamsError
from pdserve.scheduler.request import Req, StepOutput
from pdserve.server.ipc import child_setup, ipc_addr, pull_socket, push_socket
from pdserve.server.messages import (
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
    TokenizedGenerateReq,
    TokenOut,
    decode,
    encode,
)

if TYPE_CHECKING:
    from pdserve.config import ServerArgs
    from pdserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 100
STEP_DELAY_ENV = "PDSERVE_TEST_STEP_DELAY_S"  # seconds; see SchedulerProcess.step_delay_s


class SchedulerProcess:
    def __init__(self, args: ServerArgs, scheduler: Scheduler):
        self.args = args
        self.sched = scheduler
        self.ctx = zmq.Context()
        self.receiver = pull_socket(self.ctx, ipc_addr(args, "scheduler"), bind=True)
        self.to_detokenizer = push_socket(self.ctx, ipc_addr(args, "detokenizer"))
        self.to_tokenizer = push_socket(self.ctx, ipc_addr(args, "tokenizer"))
        self.poller = zmq.Poller()
        self.poller.register(self.receiver, zmq.POLLIN)
        for fd in scheduler.wakeup_fds():
            self.poller.register(fd, zmq.POLLIN)
        self.handlers: dict[type, Callable[[Any], None]] = {
            TokenizedGenerateReq: self.handle_generate,
            AbortReq: self.handle_abort,
            FlushCacheReq: self.handle_flush_cache,
            GetStatsReq: self.handle_get_stats,
        }
        self.vocab_size = int(scheduler.model_info["vocab_size"])
        # Test-only fault injection (tests/chaos): a pause before every step that has work, so that a request
        # stays in each phase long enough to be hit there. Unset (the default), nothing is slowed.
        self.step_delay_s = float(os.environ.get(STEP_DELAY_ENV) or 0.0)

    def announce_ready(self) -> None:
        self.to_tokenizer.send(encode(ProcessReady("scheduler", dict(self.sched.model_info))))

    def run_forever(self) -> None:
        self.announce_ready()
        while True:
            for msg in self.recv_requests():
                self.dispatch(msg)
            self.send_outputs(self.run_step())

    def recv_requests(self) -> list[Any]:
        """Everything queued now. With nothing to do it first sleeps until a request or a wake-up (a PD
        control message) arrives, or IDLE_POLL_MS pass so that deadlines are checked."""
        if not self.sched.can_step():
            self.poller.poll(IDLE_POLL_MS)
        messages = []
        while True:
            try:
                raw = self.receiver.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                messages.append(decode(raw))
            except MessageError as exc:
                logger.error("dropped a malformed message: %s", exc)
        return messages

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
            self.to_tokenizer.send(encode(RequestError(msg.rid, str(exc))))
            return
        settings = DecodeSettings(
            rid=msg.rid,
            skip_special_tokens=req.sampling_params.skip_special_tokens,
            stop=list(req.sampling_params.stop),
            return_logprob=req.return_logprob,
        )
        self.to_detokenizer.send(encode(settings))

    def build_req(self, msg: TokenizedGenerateReq) -> Req:
        if not msg.input_ids:
            raise ValueError("the prompt is empty")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in msg.input_ids):
            raise ValueError(f"input_ids must be token ids in [0, {self.vocab_size})")
        try:
            params = SamplingParams.from_dict(msg.sampling_params)
        except TypeError as exc:
            raise SamplingParamsError(f"bad sampling parameters: {exc}") from exc
        return Req.of(msg.rid, list(msg.input_ids), params, stream=msg.stream, bootstrap_host=msg.bootstrap_host,
                      bootstrap_port=msg.bootstrap_port, bootstrap_room=msg.bootstrap_room)

    def handle_abort(self, msg: AbortReq) -> None:
        self.sched.abort_request(msg.rid)

    def handle_flush_cache(self, msg: FlushCacheReq) -> None:
        self.to_tokenizer.send(encode(FlushCacheReply(msg.request_id, bool(self.sched.flush_cache()))))

    def handle_get_stats(self, msg: GetStatsReq) -> None:
        stats = dict(self.sched.stats())
        stats["kv_pool_fully_free"] = not self.sched.has_work() and bool(self.sched.kv_pool_is_fully_free())
        self.to_tokenizer.send(encode(GetStatsReply(msg.request_id, stats)))

    def run_step(self) -> list[StepOutput]:
        """One scheduler step; with nothing queued it only handles control messages and deadlines."""
        if self.step_delay_s and self.sched.can_step():
            time.sleep(self.step_delay_s)
        return self.sched.step()

    def send_outputs(self, outputs: list[StepOutput]) -> None:
        if outputs:
            self.to_detokenizer.send(encode(BatchTokenOut([to_token_out(out) for out in outputs])))


def to_token_out(out: StepOutput) -> TokenOut:
    return TokenOut(
        rid=out.rid,
        new_token_ids=list(out.new_token_ids),
        finish_reason=out.finish_reason,
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        cached_tokens=out.cached_tokens,
        new_logprobs=[float(lp) for lp in out.new_logprobs],
        new_top_logprobs=[_top_entries(entries) for entries in out.new_top_logprobs],
        input_logprobs=None if out.input_logprobs is None else [_maybe_float(lp) for lp in out.input_logprobs],
        input_top_logprobs=(
            None if out.input_top_logprobs is None else [_top_entries(e) for e in out.input_top_logprobs]
        ),
    )


def _top_entries(entries: list[tuple[int, float]] | None) -> list[list] | None:
    return None if entries is None else [[int(token_id), float(lp)] for token_id, lp in entries]


def _maybe_float(value: float | None) -> float | None:
    return None if value is None else float(value)


def run_scheduler_process(args: ServerArgs) -> None:
    """Entry point of a scheduler child (spawned by `launch.py`)."""
    child_setup("scheduler", args.log_level)
    from pdserve.disagg.factory import create_scheduler

    SchedulerProcess(args, create_scheduler(args)).run_forever()
