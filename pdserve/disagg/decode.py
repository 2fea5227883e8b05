"""The decode role: pre-allocates KV pages, lets the prefill server fill them, then decodes.

Per request: resolve the prefill's bootstrap route (BOOTSTRAPPING, off the scheduler thread), allocate the
prompt's pages within the memory budget and send their ids (WAITING_FOR_INPUT), then commit the first token
from `kv_done` after checking its room echo (SUCCESS) and join the running batch. The `transfer_request` offers a
receive-staging slot (`transfer/receive_staging.py`), given when the prefill asks as it starts computing the request
(`staging_ask`, answered with `staging_slot` once the arena has room); `kv_done` says whether the KV is in the slot,
to unpack, or in the pages (the slot, if given too late, comes free). Pages the prefill may
still be writing are fenced: after an abort, a transfer timeout or the prefill's loss to the heartbeat (a frozen
prefill resumes and writes late) they stay quarantined until the prefill confirms with `failed` or `kv_done`, its
bootstrap port refuses connections (its process is gone), or `--disaggregation-fence-timeout` passes. A request
this server fails before its handoff begins (its grammar does not compile) still tells the prefill: `abort` for its
room, as soon as the prefill's route is known (`refuse`).

A request without bootstrap fields (the router's conditional disaggregation chose the local path) is prefilled
here. With `--decode-tpot-budget-ms`, the scheduler's TPOT budget (`pdserve/scheduler/tpot_budget.py`) sizes its
chunks so that the running requests' mean inter-token time stays within the budget; without one, it is prefilled in
chunks of `--decode-local-prefill-chunk-size` tokens, each followed by a decode step while requests are decoding, so
a running request waits at most one chunk's forward between two tokens.

With tensor parallelism every rank pre-allocates the same pages in its own pool (its own heads); the leader
looks the route up, sends one `transfer_request` listing every rank's transfer session and KV buffer, and
receives `kv_done`, which reaches every rank as a step event (see peer_link.py).

`DecodeRole` is the part the scheduler holds (`pdserve/scheduler/role.py` lists the points where it acts). A
handoff's phases, in SGLang's words the bootstrap, pre-alloc and transfer queues, are listed in `decode_phases.py`,
with the objects that hold their state (`Routes`, `WaitingForPages`, `Fence`). Peers' messages (`peer_handlers`)
and this process's helper threads' results (`completion_handlers`) reach it apart, each when it became known
(`control_channel.py`). Its pages come by the scheduler's one admission rule (`SchedulerAPI.admit`).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import msgpack

from pdserve.config import ServerArgs
from pdserve.disagg.addressing import announced_endpoint
from pdserve.disagg.bootstrap import (BootstrapError, IncompatiblePeer, PrefillRankInfo, bootstrap_gone, bootstrap_healthy,
                                      check_compatible, fetch_prefill_route)
from pdserve.disagg.control_messages import (MAX_STRING, Abort, Failed, FirstToken, KVDone, Message, PeerDead,
                                             PeerGone, RouteResolved, StagingAsk, StagingSlot, TransferRequest)
from pdserve.disagg.decode_phases import Fence, FencedPages, Routes, WaitingForPages, bootstrap_addr
from pdserve.disagg.peer_link import PeerLink
from pdserve.disagg.transfer.receive_staging import open_receive_staging
from pdserve.disagg.handoff import (PEER_FAILED, PEER_TIMEOUT, Handoff, KVPoll, is_local_prefill,
                                     peer_status, validate_pd_request)
from pdserve.engine.model_runner import ModelRunner
from pdserve.messages import FAKE_BOOTSTRAP_HOST
from pdserve.scheduler.extend_batch import ExtendItem
from pdserve.scheduler.request import FinishReason, Req
from pdserve.scheduler.role import Role
from pdserve.timeline import KV_LANDED, PAGES_PREALLOCATED, TRANSFER_REQUEST_SENT

logger = logging.getLogger(__name__)


def decode_scheduler_args(args: ServerArgs) -> ServerArgs:
    """The decode server's scheduler flags: its own prefix cache only with `keeps_prefix_cache`, never tiered, and
    local prefills in chunks of `--decode-local-prefill-chunk-size` unless a TPOT budget sizes them."""
    chunk = args.chunked_prefill_size
    if not args.decode_tpot_budget_ms:
        chunk = min(chunk, args.decode_local_prefill_chunk_size)
    return args.replace(disable_radix_cache=not args.keeps_prefix_cache, enable_hierarchical_cache=False,
                        hicache_storage_backend=None, chunked_prefill_size=chunk)


class DecodeRole(Role):
    def __init__(self, args: ServerArgs, runner: ModelRunner, link: PeerLink | None = None):
        """`link`: the one a role switch kept (`pdserve/role_switch.py`); None opens a new one."""
        self.args = args
        self.page_size = args.page_size
        self.link = link or PeerLink(args, runner)
        self.num_local_prefills = 0
        self._extended_last_step = False
        self.handoff_reserve = math.ceil(args.num_reserved_decode_tokens / self.page_size)  # pages, each handoff
        self.routes = Routes(args.disaggregation_bootstrap_timeout)  # waiting for the bootstrap
        self.waiting_for_pages = WaitingForPages(self.routes)
        self.quarantine = Fence()  # fenced
        self.receive = self.link.kept("receive_staging", lambda: open_receive_staging(
            self.link.engine, runner.pool, args.disaggregation_staging_mb))
        self.rank_targets = self._rank_targets()
        if not all(staging for _, _, staging in self.rank_targets):
            self.receive = None  # a rank without staging (it could not have its automatic size): no rank stages
        self.route_pool = self.heartbeat = None
        if self.link.tp.is_leader:
            self.route_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="bootstrap-route")
            self.heartbeat = Heartbeat(args, self.link.channel.complete)
        if args.serves_role_alone:
            logger.warning("fake transfer backend: this decode server serves every request alone; it allocates each "
                           "prompt's pages without prefilling them, so the prompt KV is not computed and the output "
                           "is not meaningful (for benchmarking the decode role)")
        self.peer_handlers = {KVDone: self._on_kv_done, Failed: self._on_peer_failed, StagingAsk: self._on_staging_ask}
        self.completion_handlers = {PeerDead: self._on_peer_dead, PeerGone: self._on_peer_gone,
                                    RouteResolved: self._on_route_resolved}

    def _rank_targets(self) -> list[tuple[str, int, int]]:
        """Every rank's (transfer session, KV buffer address, receive staging address or 0), in rank order (one
        collective over the ranks)."""
        staging = self.receive.base if self.receive is not None else 0
        mine = msgpack.packb([self.link.engine.session_id(), self.link.region.base, staging])
        return [tuple(msgpack.unpackb(raw)) for raw in self.link.tp.all_gather_bytes(mine)]

    # ---- requests -----------------------------------------------------------------------------------------

    def validate(self, req: Req) -> None:
        validate_pd_request(req, self.link.handoffs, allow_local=True)

    def accept(self, req: Req) -> None:
        if req.bootstrap_host == FAKE_BOOTSTRAP_HOST:
            self._accept_fake(req)
            return
        if is_local_prefill(req):
            self.num_local_prefills += 1
            self.scheduler.enqueue(req)
            return
        addr = bootstrap_addr(req)
        h = Handoff(req, req.bootstrap_room, deadline=self.link.clock() + self.args.disaggregation_bootstrap_timeout)
        self.link.handoffs[h.room] = h
        self._resolve(addr)

    def refuse(self, req: Req, message: str) -> None:
        """A request failed here before its handoff began (its grammar did not compile): its prefill half learns at
        once, with this 400 and its cause, as soon as this server knows the prefill's control endpoint (its route,
        looked up now if need be: bounded by the bootstrap timeout, as for any request)."""
        if req.bootstrap_host == FAKE_BOOTSTRAP_HOST or is_local_prefill(req):
            return
        addr = bootstrap_addr(req)
        self._resolve(addr)
        self.routes.refuse_when_known(addr, Abort(req.bootstrap_room, message[:MAX_STRING], status=400),
                                      self.link.clock())
        self._send_refusals(addr)

    def _resolve(self, addr: str) -> None:
        """Look the route to `addr` up unless it is known and sound (a dead peer's, or a failed lookup's, again)."""
        if self.routes.need(addr):
            self._look_up(addr)

    def _send_refusals(self, addr: str) -> None:
        """The refusals waiting for `addr`'s route, once its lookup ended: sent if the route names the prefill's
        control endpoint, else dropped (the prefill half then ends at its own bootstrap timeout)."""
        refusals = self.routes.refusals_due(addr)
        endpoint = _control_endpoint(self.routes.get(addr)) if refusals else None
        for abort in refusals if endpoint is not None else ():
            self.link.send_control(endpoint, abort)

    def _look_up(self, addr: str) -> None:
        """The leader looks the route up off the scheduler thread; its end reaches every rank as RouteResolved."""
        if not self.link.tp.is_leader:
            return
        lookup = self.route_pool.submit(fetch_prefill_route, addr, self.args.disaggregation_bootstrap_timeout,
                                        auth=self.link.auth)
        self.routes.started(addr)
        lookup.add_done_callback(lambda done: self.link.channel.complete(route_resolved(addr, done)))
        self.heartbeat.watch(addr)

    def _accept_fake(self, req: Req) -> None:
        """No prefill peer: the request waits for its pages like a real one (`_preallocate_fake`), then decodes over
        pages that hold whatever they held (decode-only benchmarks, health checks)."""
        self.waiting_for_pages.add_fake(Handoff(req, req.bootstrap_room, deadline=self.link.clock()))

    def has_work(self) -> bool:
        return bool(self.link.handoffs or self.quarantine) or self.waiting_for_pages.has_fake()

    def can_step(self) -> bool:
        """Handoffs waiting for a message or a route need no steps (the channel's wake-up fd ends the wait); those
        whose route is known, and fake-transfer requests, need one when pages may have been freed since
        pre-allocation last had to wait."""
        return self.waiting_for_pages.may_fit(self.scheduler.available_pages(), self.link.bootstrap_queue())

    def prepare_step(self) -> bool:
        self.link.handle_events(self.peer_handlers, self.completion_handlers)
        self._expire()
        self._give_slots()
        self._preallocate()
        return not self.scheduler.has_new_outputs()  # first tokens just committed: report them before decoding

    def plan_extend(self) -> list[ExtendItem]:
        """Local prefill chunks (and recomputes of retracted requests): within the scheduler's TPOT budget when one
        is set, else alternating with decode steps."""
        if not self.args.decode_tpot_budget_ms and self._extended_last_step and self.scheduler.running:
            self._extended_last_step = False
            return []
        items = self.scheduler.schedule_extend()
        self._extended_last_step = bool(items)
        return items

    def caches_finished(self, req: Req) -> bool:
        """A fake-transfer request's pages hold no computed KV: they never enter the prefix cache."""
        return req.bootstrap_host != FAKE_BOOTSTRAP_HOST

    def abort(self, req: Req, message: str) -> bool:
        h = self.link.handoff_of(req)
        if h is not None:
            self._fail(h, message, reason="aborted", tell_prefill=True, status=None)
        return h is not None

    # ---- handshake and pre-allocation ---------------------------------------------------------------------

    def _preallocate(self) -> None:
        running = sum(self.scheduler.decode_reserve(r) for r in self.scheduler.running)
        self.waiting_for_pages.serve(self.link.bootstrap_queue(), running, self._take_pages,
                                     self.scheduler.available_pages)

    def _take_pages(self, h: Handoff, reserved: int) -> int | None:
        """h's destination pages next to `reserved` pages held back (`WaitingForPages.serve`): None when they do
        not fit, else the pages held back for h's growth (0: its handshake failed). A handoff then sends their ids
        to its prefill; a fake-transfer request decodes from its prompt's last token (no prefill ran)."""
        if h.req.bootstrap_host == FAKE_BOOTSTRAP_HOST:
            if not self._allocate_destination(h, reserved):
                return None
            held = self.scheduler.decode_reserve(h.req)
            self._commit(h, FirstToken(0, h.req.input_ids[-1]))
            return held
        route = self.routes.get(bootstrap_addr(h.req))
        try:
            info = self._check_route(route)
        except (BootstrapError, IncompatiblePeer, ValueError, KeyError) as exc:
            logger.warning("room %d: refusing prefill %s: %s", h.room, bootstrap_addr(h.req), exc)
            h.peer_control = _control_endpoint(route)
            self._fail(h, f"prefill handshake failed: {exc}", reason="handshake_failed",
                       tell_prefill=h.peer_control is not None)
            return 0
        if not self._allocate_destination(h, reserved):
            return None
        h.req.stage_marks.mark(PAGES_PREALLOCATED)
        staging_offered = self._offer_staging(h, route)
        h.peer_control = info.control_endpoint
        if self.link.tp.is_leader:  # the leader's message speaks for every rank
            self.link.send_control(h.peer_control, self._transfer_request(h, staging_offered))
        h.req.stage_marks.mark(TRANSFER_REQUEST_SENT)
        h.advance(KVPoll.WAITING_FOR_INPUT)
        h.pages_sent_at = self.link.clock()
        h.deadline = h.pages_sent_at + self.args.disaggregation_waiting_timeout
        return self.scheduler.decode_reserve(h.req)

    def _offer_staging(self, h: Handoff, route: RouteResolved) -> bool:
        """Whether h's prefill may ask for a receive-staging slot as it starts computing (`_on_staging_ask`): it
        runs this server's TP size (whole tokens) and the slot fits the arena; else it writes the pages themselves."""
        return self.receive is not None and route.route["tp_size"] == self.link.tp.size \
            and self.receive.offer(h.room, len(h.dst_pages) - h.cached_pages)

    def _transfer_request(self, h: Handoff, staging_offered: bool) -> TransferRequest:
        advertise, peer_host = self.args.disaggregation_advertise_host, h.req.bootstrap_host
        targets = [(announced_endpoint(session, advertise, peer_host), base) for session, base, _ in self.rank_targets]
        return TransferRequest(
            h.room, h.req.rid, announced_endpoint(self.link.channel.endpoint, advertise, peer_host), targets[0][0],
            self.link.description, targets[0][1], h.dst_pages, self.args.disaggregation_enable_kv_checksum,
            h.cached_pages, rank_targets=targets, staging_offered=staging_offered,
        )

    def _allocate_destination(self, h: Handoff, reserved: int) -> bool:
        """The prompt's pages, admitted by the scheduler's rule next to `reserved` pages of others' growth: the
        prefix this server's radix cache holds (referenced, never written by the prefill) plus fresh pages for the
        rest, with `--num-reserved-decode-tokens` held back for its own growth."""
        if not self.scheduler.admit(h.req, reserved, handoff_reserve=self.handoff_reserve):
            return False
        h.cached_pages, h.dst_pages = h.req.num_cached_tokens // self.page_size, h.req.pages
        return True

    def _check_route(self, route: RouteResolved) -> PrefillRankInfo:
        """Rank 0's registration (the leader's endpoint speaks for every prefill rank) once the whole topology
        pairs with this server's."""
        topology = route.route
        if route.error is not None:
            raise BootstrapError(route.error)
        if not isinstance(topology.get("ranks"), dict):
            raise ValueError("the bootstrap server's route is not a map with 'ranks'")
        check_compatible(topology, self.link.description)
        expected = [str(r) for r in range(topology["tp_size"])]
        if sorted(topology["ranks"]) != sorted(expected):
            raise ValueError(f"the route lists ranks {sorted(topology['ranks'])[:8]} for TP {topology['tp_size']}")
        return PrefillRankInfo.from_json(topology["ranks"].get("0"))

    # ---- control messages ---------------------------------------------------------------------------------

    def _on_route_resolved(self, msg: RouteResolved) -> None:
        self.routes.resolved(msg)
        self._send_refusals(msg.addr)

    def _on_kv_done(self, msg: KVDone, arrived_at: float) -> None:
        """The prefill's last write landed before it sent this: the KV is here since `arrived_at`."""
        room = msg.room
        if room in self.quarantine:
            self._release_quarantine(room)
            return
        h = self.link.handoffs.get(room)
        if h is None or h.poll != KVPoll.WAITING_FOR_INPUT:
            return
        h.req.stage_marks.mark(KV_LANDED, arrived_at)
        try:
            self._take_kv(h, msg.staged)  # before the checksum and forwards read the pages
            self._check_first_token(msg.aux, h)
        except ValueError as exc:
            self._fail(h, f"bad kv_done from prefill: {exc}", reason="bad_first_token", tell_prefill=False)
            return
        self._commit(h, msg.aux)

    def _take_kv(self, h: Handoff, staged: bool) -> None:
        """h's KV into its pages: unpacked from its slot when the prefill wrote it there, else in place already (and
        its slot, offered or given too late, comes free)."""
        if not staged:
            if self.receive is not None:
                self.receive.written_in_place(h.room)
            return
        if self.receive is None or h.room not in self.receive.slots:
            raise ValueError(f"its KV is staged, but room {h.room} was given no receive-staging slot")
        self.receive.unpack(h.room, h.dst_pages[h.cached_pages :])

    def _check_first_token(self, aux: FirstToken, h: Handoff) -> None:
        vocab = self.link.model_config.vocab_size
        if aux.room != h.room:
            raise ValueError(f"room echo {aux.room} != {h.room}")
        if not 0 <= aux.first_token < vocab:
            raise ValueError(f"first token {aux.first_token} is outside the vocabulary")
        if not all(0 <= t < vocab for t, _ in aux.top_logprobs or ()):
            raise ValueError("a top-logprob token is outside the vocabulary")
        received = h.dst_pages[h.cached_pages :]
        if self.args.disaggregation_enable_kv_checksum and aux.kv_checksum != self.link.pages_checksum(received):
            raise ValueError("KV checksum mismatch: the pages did not arrive intact")

    def _commit(self, h: Handoff, aux: FirstToken) -> None:
        req = h.req
        if self.link.handoffs.get(h.room) is h:
            del self.link.handoffs[h.room]
        h.advance(KVPoll.SUCCESS)
        if h.pages_sent_at is not None:  # not a fake-transfer request
            layout = self.link.region.layout  # each rank received its own heads of the pages
            self.link.transfer_stats.moved((len(h.dst_pages) - h.cached_pages) * layout.page_bytes * 2 * layout.num_layers
                                      * self.link.tp.size)
            self.link.transfer_stats.completed(self.link.clock() - h.pages_sent_at)
        req.num_cached_tokens = len(req.input_ids)
        tops = list(aux.top_logprobs or [])[: req.top_logprobs_num]
        self.scheduler.add_token(req, aux.first_token, aux.logprob, tops)
        if not req.finished:
            self.scheduler.start_decoding(req)

    def _on_staging_ask(self, msg: StagingAsk, _arrived_at: float) -> None:
        """The prefill starts computing the room: its offered slot waits for room in the arena (`_give_slots`); a
        room offered none, or asked for already, is answered none at once. A handoff that ended meanwhile (failed
        here, or its `kv_done` came first) needs no answer."""
        h = self.link.handoffs.get(msg.room)
        if h is None or h.poll != KVPoll.WAITING_FOR_INPUT:
            return
        if self.receive is None or not self.receive.ask(h.room):
            self.link.send_control(h.peer_control, StagingSlot(h.room))

    def _give_slots(self) -> None:
        """Slots whose unpack has run come free, then the asks waiting for room get theirs, oldest first: each
        rank's slot address goes to the prefill (only handoffs receiving KV ask: the others' asks are withdrawn)."""
        if self.receive is None:
            return
        self.receive.collect()
        for room in self.receive.grant():
            h = self.link.handoffs[room]
            bases = [self.receive.destination(room, base).base for _, _, base in self.rank_targets]
            self.link.send_control(h.peer_control, StagingSlot(room, bases, len(h.dst_pages) - h.cached_pages))

    def _on_peer_failed(self, msg: Failed, _arrived_at: float) -> None:
        room = msg.room
        if room in self.quarantine:
            self._release_quarantine(room)
        h = self.link.handoffs.get(room)
        if h is not None:
            self._fail(h, f"prefill server failed the request: {msg.error}", reason="peer_failed",
                       tell_prefill=False, status=peer_status(msg.status))

    def _on_peer_dead(self, msg: PeerDead) -> None:
        addr = msg.addr
        self.routes.peer_dead(addr)
        for h in [h for h in self.link.handoffs.values() if bootstrap_addr(h.req) == addr]:
            # told, and its pages fenced: a frozen prefill resumes, writes what it had queued, then confirms
            self._fail(h, f"prefill server at {addr} stopped answering its heartbeat", reason="peer_dead",
                       tell_prefill=True)

    def _on_peer_gone(self, msg: PeerGone) -> None:
        for room in self.quarantine.rooms_of(msg.addr):
            self._release_quarantine(room)  # its process exited: it writes nothing more

    def _expire(self) -> None:
        """Fail the handoffs whose deadline passed; release the quarantined pages whose grace ended."""
        t = self.link.clock()
        for h in list(self.link.handoffs.values()):
            if t > h.deadline:
                handshaking = h.poll == KVPoll.BOOTSTRAPPING
                what = "handshake" if handshaking else "KV transfer"
                self._fail(h, f"prefill {what} timed out for bootstrap_room {h.room}",
                           reason="handshake_timeout" if handshaking else "transfer_timeout", tell_prefill=True,
                           status=PEER_TIMEOUT)
        for room in self.quarantine.expired(t):
            self._release_quarantine(room)
        self.routes.expire_refusals(t)

    def _fail(self, h: Handoff, error: str, reason: str, tell_prefill: bool, status: int | None = PEER_FAILED) -> None:
        """End the request (answered with HTTP `status`; None for a client's abort; `reason` labels the failure
        metric). If the prefill may still write into its pages, they wait in quarantine."""
        self.link.handoffs.pop(h.room, None)
        if h.poll != KVPoll.FAILED:
            self.link.transfer_stats.failed(reason)
        may_write = h.poll == KVPoll.WAITING_FOR_INPUT and tell_prefill
        h.advance(KVPoll.FAILED, error)
        if tell_prefill and h.peer_control is not None:
            self.link.send_control(h.peer_control, Abort(h.room, error))
        if may_write and h.req.pages:
            fence_deadline = self.link.clock() + self.args.disaggregation_fence_timeout
            self.quarantine.hold(h.room, FencedPages(h.req.pages, fence_deadline, bootstrap_addr(h.req)))
            h.req.pages = []
        if self.receive is not None and h.room in self.quarantine:
            self.receive.withdraw(h.room)  # a slot it was given stays fenced with its pages
        elif self.receive is not None:
            self.receive.drop(h.room)
        self.scheduler.finish(h.req, FinishReason("abort", message=error, status_code=status))

    def _release_quarantine(self, room: int) -> None:
        self.scheduler.allocator.free(self.quarantine.release(room))
        if self.receive is not None:
            self.receive.drop(room)

    # ---- the scheduler process ----------------------------------------------------------------------------

    def idle_poll_ms(self) -> int:
        return self.link.idle_poll_ms()

    def wakeup_fds(self) -> list[int]:
        return [self.link.channel.wakeup_fd]

    def holds_pages(self) -> bool:
        return bool(self.quarantine)

    def stats(self) -> dict:
        return {"kv_transfer": self.link.transfer_snapshot(), "num_local_prefills": self.num_local_prefills,
                "receive_staging": self.receive.snapshot() if self.receive is not None else None}

    def offered_prefill_rate(self, rate: float) -> float:
        """Local prompts only within a TPOT budget: without one they would flood the running requests' TPOT."""
        return rate if self.args.decode_tpot_budget_ms else 0.0

    def reset_stats(self) -> None:
        self.num_local_prefills = 0

    def server_info(self) -> dict:
        return self.link.server_info()

    def close(self) -> None:
        self.detach_link().close()

    def detach_link(self) -> PeerLink:
        """Stop the role's threads; the peer link stays open for the next role."""
        if self.link.tp.is_leader:
            self.heartbeat.close()
            self.route_pool.shutdown(wait=False, cancel_futures=True)
        return self.link


def route_resolved(addr: str, lookup: Future) -> RouteResolved:
    """How a finished route lookup ended, as the event every rank handles."""
    if lookup.cancelled():
        return RouteResolved(addr, error="the route lookup was cancelled")
    exc = lookup.exception()
    if exc is not None:
        return RouteResolved(addr, error=f"{type(exc).__name__}: {exc}"[:MAX_STRING])
    route = lookup.result()
    if not isinstance(route, dict):
        return RouteResolved(addr, error="the bootstrap server's route is not a map with 'ranks'")
    return RouteResolved(addr, route=route)


def _control_endpoint(route: RouteResolved) -> str | None:
    """The prefill leader's control endpoint, when the route lookup itself succeeded (so it can be told to stop)."""
    try:
        endpoint = route.route["ranks"]["0"]["control_endpoint"]
    except Exception:  # the lookup failed or the answer is malformed: nobody to tell
        return None
    return endpoint if isinstance(endpoint, str) else None


class Heartbeat:
    """Pings each prefill bootstrap server; after N misses in a row completes with `peer_dead`. A dead
    peer is then probed until its bootstrap port refuses connections (`peer_gone`: its fenced pages come back) or
    it is watched again."""

    def __init__(self, args: ServerArgs, complete: Callable[[Message], None]):
        self.interval = args.disaggregation_heartbeat_interval
        self.max_failures = args.disaggregation_heartbeat_failures
        self.complete = complete
        self.failures: dict[str, int] = {}
        self.dead: set[str] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="pd-heartbeat", daemon=True)
        self.thread.start()

    def watch(self, addr: str) -> None:
        with self.lock:
            self.failures.setdefault(addr, 0)
            self.dead.discard(addr)

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            with self.lock:
                watched, dead = list(self.failures), list(self.dead)
            for addr in watched:
                self._ping(addr)
            for addr in dead:
                self._probe_gone(addr)

    def _ping(self, addr: str) -> None:
        alive = bootstrap_healthy(addr, timeout_s=min(self.interval, 2.0))
        with self.lock:
            if addr not in self.failures:
                return
            self.failures[addr] = 0 if alive else self.failures[addr] + 1
            dead = self.failures[addr] >= self.max_failures
            if dead:
                del self.failures[addr]
                self.dead.add(addr)
        if dead:
            self.complete(PeerDead(addr))

    def _probe_gone(self, addr: str) -> None:
        gone = bootstrap_gone(addr, timeout_s=min(self.interval, 2.0))
        with self.lock:
            gone = gone and addr in self.dead
            if gone:
                self.dead.discard(addr)
        if gone:
            self.complete(PeerGone(addr))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
