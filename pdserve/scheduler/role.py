"""Every point where a server's role acts on the scheduler: the colocated role's defaults, one method a point.

A `Scheduler` holds one role: this colocated one, or a PD role of `pdserve.disagg` (prefill, decode) that
overrides the points it needs. A role reaches back only through `SchedulerAPI`, the scheduler's public side.

In the order a request meets them:
  validate, accept                          a request arrives (`add_request`)
  refuse                                    ... or ends before the role has it (its grammar fails to compile)
  prepare_step, plan_extend                 each step begins; which prompts this step prefills
  layer_hook, on_chunk_done, on_prefill_done  a prefill forward runs, a chunk lands, the prompt is done
  check_stop, caches_finished, keeps_pages  a token is appended; the request ends; its pages are released
  holds_output                              the step's outputs are reported
  abort                                     a client aborts it
and, for the scheduler process: can_step, has_work, idle_poll_ms, wakeup_fds, holds_pages, stats, reset_stats,
queued_prefill_tokens, offered_prefill_rate, server_info, warmup_bootstrap, close.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdserve.mem_cache.kv_pool import PageAllocator
    from pdserve.scheduler.extend_batch import ExtendItem
    from pdserve.scheduler.request import FinishReason, Req
    from pdserve.scheduler.stop import StopChecker

IDLE_POLL_MS = 100


class SchedulerAPI(Protocol):
    """All a role may use of its scheduler (`Scheduler` documents each method)."""

    reqs: dict[str, Req]
    running: list[Req]
    allocator: PageAllocator
    stop_checker: StopChecker

    def enqueue(self, req: Req) -> None: ...
    def schedule_extend(self) -> list[ExtendItem]: ...
    def start_decoding(self, req: Req) -> None: ...
    def cache_kv(self, req: Req) -> None: ...
    def add_token(self, req: Req, token: int, logprob: float | None = None, top_logprobs: list | None = None
                  ) -> None: ...
    def has_new_outputs(self) -> bool: ...
    def report(self, req: Req) -> None: ...
    def finish(self, req: Req, reason: FinishReason) -> None: ...
    def end(self, req: Req, reason: FinishReason) -> None: ...
    def admit(self, req: Req, reserved: int, handoff_reserve: int | None = None) -> bool: ...
    def release_pages(self, req: Req) -> None: ...
    def available_pages(self) -> int: ...
    def decode_reserve(self, req: Req) -> int: ...


class Role:
    """The colocated role: every request is prefilled and decoded here. `bind` runs once, in `Scheduler.__init__`."""

    scheduler: SchedulerAPI

    def bind(self, scheduler: SchedulerAPI) -> None:
        self.scheduler = scheduler

    # ---- a request's life ---------------------------------------------------------------------------------

    def validate(self, req: Req) -> None:
        """Raise ValueError for a request this role cannot serve (after the scheduler's own checks)."""

    def accept(self, req: Req) -> None:
        """A validated request arrives; colocated, it queues for prefill (the PD roles first run the handshake)."""
        self.scheduler.enqueue(req)

    def refuse(self, req: Req, message: str) -> None:
        """The scheduler failed req with a 400 before accepting it (`message`: why); a PD role tells its peer."""

    def prepare_step(self) -> bool:
        """Runs first in every step (the PD roles read their peers' messages). False skips this step's forward
        pass, so that the step only reports what changed."""
        return True

    def plan_extend(self) -> list[ExtendItem]:
        """The prefill chunks of this step's extend forward (none: a decode step)."""
        return self.scheduler.schedule_extend()

    def layer_hook(self, items: list[ExtendItem]) -> Callable[[int], None] | None:
        """A callback run after each layer of this extend forward (the prefill role streams KV)."""
        return None

    def on_chunk_done(self, req: Req, start: int, end: int) -> None:
        """KV of positions [start, end) is now in req.pages (the prefill role ships it)."""

    def on_prefill_done(self, req: Req) -> None:
        """The prompt is prefilled and the first token sampled; colocated: cache its KV and start decoding."""
        self.scheduler.cache_kv(req)
        self.scheduler.start_decoding(req)

    def check_stop(self, req: Req) -> FinishReason | None:
        """Why req stops after its newest token, or None (the prefill role leaves that to the decode side)."""
        return self.scheduler.stop_checker.check(req)

    def caches_finished(self, req: Req) -> bool:
        """Whether req's KV enters the prefix cache when it finishes (unless aborted)."""
        return True

    def holds_output(self, req: Req) -> bool:
        """True to report req's new tokens later, when the role calls `report` (the prefill role: a first token
        computed before its decode claimed the request); asked only while req has not ended."""
        return False

    def keeps_pages(self, req: Req) -> bool:
        """True while something other than a forward pass still reads req's pages (the prefill role's KV
        writes); they are not freed now, and whoever holds them releases them once done."""
        return False

    def abort(self, req: Req, message: str) -> bool:
        """A client aborts req; True when the role ended it itself (a PD handoff), else the scheduler does."""
        return False

    # ---- the scheduler process ----------------------------------------------------------------------------

    def can_step(self) -> bool:
        """The role has work for the next step beyond the scheduler's queues (decode: pages to pre-allocate)."""
        return False

    def has_work(self) -> bool:
        """The role holds requests that wait for a message from a peer, not for a step."""
        return False

    def idle_poll_ms(self) -> int:
        """How long the scheduler process may sleep waiting for a request or a wake-up fd when it cannot step:
        the longest a deadline check waits."""
        return IDLE_POLL_MS

    def wakeup_fds(self) -> list[int]:
        """File descriptors that become readable when work arrives other than through add_request."""
        return []

    def holds_pages(self) -> bool:
        """The role holds KV pages outside any request (decode: quarantined pages a peer may still write)."""
        return False

    def stats(self) -> dict:
        """The role's own entries of the scheduler's stats."""
        return {}

    def reset_stats(self) -> None:
        """The role's counters start over (after the warm-up)."""

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens the role holds that the scheduler has not queued yet (prefill: its bootstrap queue)."""
        return 0

    def offered_prefill_rate(self, rate: float) -> float:
        """The prefill rate (tokens/s) `/load` offers new prompts, given the rate the scheduler can give them now
        (the decode role offers none without a TPOT budget)."""
        return rate

    def server_info(self) -> dict:
        """The role's own entries of the model info the server announces."""
        return {}

    @property
    def warmup_bootstrap(self) -> dict:
        """Bootstrap fields of the warm-up's requests (`warmup.py`): none, but a PD prefill needs its fake peer."""
        return {}

    def close(self) -> None:
        """Stop the role's threads and sockets."""
