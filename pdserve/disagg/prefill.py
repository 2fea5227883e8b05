"""The prefill role: computes a prompt's KV and first token, then pushes both to the decode server.

A request is queued for prefill as soon as it arrives: it computes into its own pages while its decode side
allocates the destination pages (BOOTSTRAPPING: no page list yet). Only the KV writes wait for the page list: once
it is known (WAITING_FOR_INPUT), each prefill chunk's newly filled pages are pushed; pages computed before it came
are pushed when it comes. After the last chunk the remaining pages and the first token follow (TRANSFERRING). When
the last write lands, `kv_done` carries the first token to the decode side and the request ends here (SUCCESS).

Where the pages are written: when the decode offered a receive-staging slot (`transfer_request`), the prefill asks
for it (`staging_ask`) once the request's computing begins and its page list is known, never while it waits in the
queue, and holds its writes until the answer (`staging_slot`: the slot, or none), at most
`--disaggregation-staging-wait-ms` from the first write held; the KV then goes into the slot, or into the pages when
none came in time, and `kv_done` says which. With tensor parallelism every rank handles the answer, and the wait's
end, at the same step.

Computing ahead is bounded: requests queued without a page list may claim at most
`--disaggregation-prefill-ahead-share` of the pool (their whole prompts' pages); beyond it a request waits for its
page list (or for others' lists to free the budget), so a decode that has no pages for its requests cannot fill
this pool with KV nobody will take. A share of 0 queues every request only once its page list came.

`PrefillRole` is the part the scheduler holds (`pdserve/scheduler/role.py` lists the points where it acts); its
queues, in SGLang's words: the bootstrap queue (handoffs without their decode side's pages: computing, or held
back by the budget), the scheduler's waiting queue, then the transfer queue (TRANSFERRING: writes in flight until
the last one lands). The handoff's phases are listed in `prefill_phases.py`, with the objects that hold their state
(`HeldBack`, `SlotAsks`, `FinalWrites`).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from pdserve.config import ServerArgs
from pdserve.disagg.addressing import registered_endpoint
from pdserve.disagg.bootstrap import BootstrapServer, IncompatiblePeer, PrefillRankInfo, check_compatible, register_prefill_rank
from pdserve.disagg.control_messages import (MAX_STRING, Abort, Failed, FirstToken, KVDone, Message, StagingAsk,
                                             StagingSlot, TransferRequest, WriteDone, WriteFailed, to_wire, tp_targets)
from pdserve.disagg.early_requests import EarlyRequests
from pdserve.disagg.head_map import head_slices
from pdserve.disagg.peer_link import PeerLink
from pdserve.disagg.prefill_phases import FinalWrites, HeldBack, SlotAsks, prompt_pages
from pdserve.disagg.handoff import (PEER_FAILED, PEER_TIMEOUT, Handoff, KVPoll,
                                     checked_cached_pages, checked_pages, peer_status, validate_pd_request)
from pdserve.disagg.transfer import (KVRegion, KVTarget, TransferError, coalesce_page_runs,
                                     layout_from_description)
from pdserve.disagg.transfer.base import StagedDestination
from pdserve.disagg.transfer.packing import KVMover, KVPiece, staging_bytes
from pdserve.disagg.control_transport import PeerClients
from pdserve.engine.model_runner import ModelRunner
from pdserve.messages import FAKE_BOOTSTRAP_HOST
from pdserve.scheduler.extend_batch import ExtendItem
from pdserve.scheduler.request import FinishReason, Req
from pdserve.scheduler.role import Role
from pdserve.timeline import (BOOTSTRAP_RESOLVED, DECODE_PAGES_KNOWN, HANDOFF_RELEASED, KV_WRITES_ISSUED,
                              KV_WRITES_LANDED)

logger = logging.getLogger(__name__)
MAX_PEER_ERROR_CHARS = 1000  # of an abort's reason from the decode side


@dataclass(slots=True)
class WriteJob:
    room: int
    peer_session: str
    pieces: list[KVPiece]
    final: bool
    computed: torch.cuda.Event | None  # recorded after the kernels that filled the pages (None on CPU)
    notify: tuple[str, KVDone] | None = None  # (peer control endpoint, message) to send once the write landed
    count: int = 1  # jobs merged into this one

    def ready(self) -> bool:
        return self.computed is None or self.computed.query()

    def absorb(self, later: WriteJob) -> None:
        self.pieces.extend(later.pieces)
        self.final, self.computed, self.notify = later.final, later.computed, later.notify
        self.count += later.count


class TransferWorker:
    """Runs one decode peer's KV writes in order on one thread; reports each result to the scheduler through `complete`. The final
    write's `kv_done` goes to the decode server from here, not after a round trip through a busy scheduler.

    Queued jobs of the same room whose KV is already computed are merged into one engine call, so layer-wise
    pushes become fewer, larger writes whenever the link is slower than the forward."""

    def __init__(self, mover: KVMover, complete: Callable[[Message], None], cancelled: set[int], peer_session: str,
                 peers: PeerClients):
        self.mover = mover
        self.complete = complete
        self.jobs: queue.SimpleQueue[WriteJob | None] = queue.SimpleQueue()
        self.cancelled = cancelled  # rooms whose writes are skipped; shared by the writers of all peers
        self.peers = peers  # used from the writer thread only
        self.thread = threading.Thread(target=self._run, name=f"kv-writer-{peer_session}", daemon=True)
        self.thread.start()

    def submit(self, job: WriteJob) -> None:
        self.jobs.put(job)

    def _run(self) -> None:
        pending: deque[WriteJob | None] = deque()
        while True:
            if not pending:
                pending.append(self.jobs.get())
            job = pending.popleft()
            if job is None:
                return
            if job.computed is not None:
                job.computed.synchronize()  # a transfer engine copies on its own streams
            self._absorb_ready(job, pending)
            self.complete(self._write(job))

    def _absorb_ready(self, job: WriteJob, pending: deque) -> None:
        try:
            while True:
                pending.append(self.jobs.get_nowait())
        except queue.Empty:
            pass
        while not job.final and pending and pending[0] is not None and pending[0].room == job.room \
                and pending[0].peer_session == job.peer_session and pending[0].ready():
            job.absorb(pending.popleft())

    def _write(self, job: WriteJob) -> WriteDone | WriteFailed:
        if job.room in self.cancelled:
            return WriteDone(job.room, job.count, landed_at=time.monotonic())
        started = time.perf_counter()
        try:
            nbytes = self.mover.write(job.peer_session, job.pieces) if job.pieces else 0
            landed, seconds = time.monotonic(), time.perf_counter() - started  # before kv_done leaves
            if job.notify is not None:
                endpoint, msg = job.notify
                self.peers.get(endpoint).send(to_wire(msg))
        except Exception as exc:  # any engine failure fails this room only
            return WriteFailed(job.room, job.count, f"{type(exc).__name__}: {exc}")
        return WriteDone(job.room, job.count, nbytes, seconds, landed)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=10)
        self.peers.close()


class KVWriters:
    """One `TransferWorker` per decode peer, started on its first write: a peer that stops answering stalls only
    its own writes (each ends at the engine's timeout), never the transfers to healthy peers."""

    def __init__(self, mover: KVMover, complete: Callable[[Message], None],
                 new_peer_clients: Callable[[], PeerClients]):
        self.mover = mover
        self.complete = complete
        self.new_peer_clients = new_peer_clients  # each writer thread signs with clients of its own
        self.cancelled: set[int] = set()
        self.workers: dict[str, TransferWorker] = {}

    def submit(self, job: WriteJob) -> None:
        worker = self.workers.get(job.peer_session)
        if worker is None:
            worker = TransferWorker(self.mover, self.complete, self.cancelled, job.peer_session, self.new_peer_clients())
            self.workers[job.peer_session] = worker
        worker.submit(job)

    def close(self) -> None:
        for worker in self.workers.values():
            worker.jobs.put(None)  # all stop in parallel; a worker stuck on a dead peer delays none of the others
        for worker in self.workers.values():
            worker.close()


class PrefillRole(Role):
    """With tensor parallelism every rank pushes its own KV heads straight into the decode ranks that hold them
    (`KVTarget`s), each through its own transfer engine; a room counts as written once the writes of all ranks
    landed (see `_on_write_done`), and then the leader sends `kv_done`."""

    def __init__(self, args: ServerArgs, runner: ModelRunner, link: PeerLink | None = None):
        """`link`: the one a role switch kept (`pdserve/role_switch.py`); None opens a new one."""
        self.args = args
        self.page_size = args.page_size
        self.device = runner.device
        self.link = link or PeerLink(args, runner)
        mover = self.link.kept("kv_mover", lambda: KVMover(self.link.engine, self.device,
                                                           staging_bytes(runner.pool.nbytes),
                                                           args.disaggregation_waiting_timeout))
        self.writers = KVWriters(mover, self.link.channel.complete, self.link.channel.new_peer_clients)
        self.bootstrap = None
        sessions = self._rank_sessions()
        if args.serves_role_alone:
            logger.warning("fake transfer backend: this prefill server serves every request alone, without a "
                           "bootstrap server; it prefills, hands the KV to nobody and answers with the first token")
        elif self.link.tp.is_leader:
            self.bootstrap = BootstrapServer(args.host, args.disaggregation_bootstrap_port, self.link.tp.size, self.link.auth)
            for rank, session in enumerate(sessions):
                register_prefill_rank(self.bootstrap.local_address, self._rank_info(rank, session), auth=self.link.auth)
        self.final_writes = FinalWrites()  # writing
        self.held_back = HeldBack(int(runner.pool.layout.num_pages * args.disaggregation_prefill_ahead_share),
                                  self.page_size)
        self.early_requests = EarlyRequests(runner.pool.layout.num_pages, args.disaggregation_bootstrap_timeout)
        self.slot_asks = SlotAsks(args.disaggregation_staging_wait_ms / 1000)
        self.peer_handlers = {TransferRequest: self._on_transfer_request, Abort: self._on_peer_abort,
                              StagingSlot: self._on_staging_slot}
        self.completion_handlers = {WriteDone: self._on_write_done, WriteFailed: self._on_write_failed}

    def _rank_sessions(self) -> list[str]:
        """Every rank's transfer session as peers reach it, in rank order (one collective over the ranks)."""
        mine = registered_endpoint(self.link.engine.session_id(), self.args.disaggregation_advertise_host)
        return [raw.decode() for raw in self.link.tp.all_gather_bytes(mine.encode())]

    def _rank_info(self, rank: int, session: str) -> PrefillRankInfo:
        """The bootstrap registration of one rank: its transfer session; control messages for every rank go to
        the leader's endpoint; every rank's pool has the same layout (its own heads)."""
        return PrefillRankInfo(
            rank=rank, control_endpoint=registered_endpoint(self.link.channel.endpoint, self.args.disaggregation_advertise_host),
            transfer_session=session, transfer_backend=self.link.engine.name, kv_layout=self.link.description["kv_layout"],
            model=self.link.description["model"], tp_size=self.link.tp.size,
        )

    # ---- requests -----------------------------------------------------------------------------------------

    def validate(self, req: Req) -> None:
        validate_pd_request(req, self.link.handoffs)

    def accept(self, req: Req) -> None:
        if req.bootstrap_host == FAKE_BOOTSTRAP_HOST:
            self.scheduler.enqueue(req)  # prefilled like any request; nothing is sent
            return
        h = Handoff(req, req.bootstrap_room, deadline=self.link.clock() + self.args.disaggregation_bootstrap_timeout)
        self.link.handoffs[h.room] = h
        self.early_requests.refusals.take(h.room)  # one left by an earlier request with this room stands no more
        self.held_back.hold(h)  # queued at this step's start, within the budget (`HeldBack.due`)
        early = self.early_requests.pop(h.room)
        if early is not None:  # its decode's claim came first: it resolves now
            self._on_transfer_request(early, time.monotonic())
        aborted = self.early_requests.aborts.take(h.room)
        if aborted is not None:  # the decode failed its half before this one arrived
            self._on_peer_abort(aborted, time.monotonic())

    def refuse(self, req: Req, message: str) -> None:
        """A request failed here before its handoff began: its decode half learns at once, if its claim came
        already, else as soon as it comes."""
        if req.bootstrap_host == FAKE_BOOTSTRAP_HOST or req.bootstrap_room is None:
            return
        answer = Failed(req.bootstrap_room, message[:MAX_STRING], status=400)
        self.early_requests.aborts.take(answer.room)  # the decode's abort, if it came first, has nothing left to end
        control = self.early_requests.take_control(answer.room)
        if control is not None:
            self.link.send_control(control, answer)
        else:
            self.early_requests.refusals.put(answer.room, answer, self.link.clock())

    def prepare_step(self) -> bool:
        self.link.handle_events(self.peer_handlers, self.completion_handlers)
        self._expire()
        for h in self.held_back.due(self.link.bootstrap_queue()):
            self.scheduler.enqueue(h.req)
        return True

    def plan_extend(self) -> list[ExtendItem]:
        """This step's prompt chunks; a handoff whose decode offered a receive-staging slot asks for it as its
        computing begins, so a request waiting in the queue holds none."""
        items = self.scheduler.schedule_extend()
        for item in items:
            h = self.link.handoff_of(item.req)
            if h is not None and _pages_known(h):
                self._ask_slot(h)
        return items

    def abort(self, req: Req, message: str) -> bool:
        h = self.link.handoff_of(req)
        if h is not None:
            self._fail(h, message, reason="aborted", status=None)
        return h is not None

    def holds_output(self, req: Req) -> bool:
        """A first token computed before the decode's page list came is not reported yet: a request that no decode
        claims then fails with its 504 before the answer's first byte, so the router may retry it elsewhere."""
        h = self.link.handoff_of(req)
        return h is not None and h.poll == KVPoll.BOOTSTRAPPING

    def check_stop(self, req: Req) -> FinishReason | None:
        return None  # the decode side decides when generation stops, starting with the first token

    # ---- KV push ------------------------------------------------------------------------------------------

    def layer_hook(self, items: list[ExtendItem]) -> Callable[[int], None] | None:
        """Large chunks push each layer's KV as soon as the layer has stored it, overlapping the forward."""
        min_tokens = self.args.disaggregation_layerwise_min_tokens
        plans = []
        for item in items:
            h = self.link.handoff_of(item.req)
            if min_tokens and h is not None and self._slot_settled(h) and item.end - item.start >= min_tokens:
                runs = self._runs_to_send(h, self._pages_complete_after(item))
                if runs:
                    plans.append((h, runs))
        if not plans:
            return None

        def push_layer(layer: int) -> None:
            computed = self._record_event()
            for h, runs in plans:
                for target in h.peer_targets:
                    self._submit(h, target, self._pieces(h, target, runs, range(layer, layer + 1)), False, computed)

        return push_layer

    def on_chunk_done(self, req: Req, start: int, end: int) -> None:
        h = self.link.handoff_of(req)
        if h is not None and end < len(req.input_ids):  # the last chunk's pages go with the first token
            h.pages_computed = end // self.page_size
            self._push_computed(h)

    def _pages_complete_after(self, item: ExtendItem) -> int:
        """Pages of the request whose every position is filled once this chunk's forward has run."""
        if item.completes_prefill:
            return math.ceil(len(item.req.input_ids) / self.page_size)
        return item.end // self.page_size

    def on_prefill_done(self, req: Req) -> None:
        h = self.link.handoff_of(req)
        if h is None:  # a fake-transfer request ends with its first token
            self.scheduler.finish(req, FinishReason("length"))
            return
        self.scheduler.cache_kv(req)  # the prompt's KV: every position it computed
        h.pages_computed, h.prefilled = prompt_pages(h, self.page_size), True
        self._push_computed(h)

    def _push_computed(self, h: Handoff) -> None:
        """What is computed and not sent yet, with the first token once the prompt is prefilled: once the page list
        is known and where the KV goes is settled (`_may_write`)."""
        if not self._may_write(h):
            return
        self._push(h, h.pages_computed, final=h.prefilled)
        if h.prefilled:
            h.advance(KVPoll.TRANSFERRING)

    def _may_write(self, h: Handoff) -> bool:
        """Whether h's computed KV may be written now: its page list is known, something is computed and not sent,
        and its staging is settled; an offered slot not asked for yet is asked for now, and its answer awaited."""
        if not _pages_known(h) or (h.pages_computed <= h.pages_sent and not h.prefilled):
            return False
        self._ask_slot(h)
        return not self.slot_asks.holds(h.room, self.link.clock())

    def _slot_settled(self, h: Handoff) -> bool:
        """h's page list is known and no answer to a receive-staging ask is awaited: its writes go where it says."""
        return _pages_known(h) and not self.slot_asks.waiting(h.room)

    def _ask_slot(self, h: Handoff) -> None:
        if self.slot_asks.ask(h.room):
            self.link.send_control(h.peer_control, StagingAsk(h.room))

    def _push(self, h: Handoff, upto_page: int, final: bool) -> None:
        """All layers of the pages not sent yet, up to `upto_page`; `final` also releases the first token: from
        the writer once its write landed when it is the room's only writer, else from the leader once every
        rank's writes landed."""
        if h.poll == KVPoll.FAILED or (upto_page <= h.pages_sent and not final):
            return
        runs = self._runs_to_send(h, upto_page)
        notify = None
        if final:
            sole_writer = self.link.tp.size == 1 and len(h.peer_targets) == 1
            staged = any(target.staged is not None for target in h.peer_targets)
            kv_done = self.final_writes.hold_unless_sole(KVDone(h.room, h.req.rid, self._first_token(h), staged),
                                                         sole_writer)
            notify = None if kv_done is None else (h.peer_control, kv_done)
        computed = self._record_event()
        for target in h.peer_targets:
            self._submit(h, target, self._pieces(h, target, runs), final, computed, notify)

    def _pieces(self, h: Handoff, target: KVTarget, runs: list, layers: range | None = None) -> list[KVPiece]:
        """This rank's heads for `target` in the page `runs`, all layers by default (none when it takes none of
        them from us); into the target's receive staging when it gave a slot, at the runs' page positions."""
        if not runs or not target.heads:
            return []
        layers = range(self.link.region.layout.num_layers) if layers is None else layers
        staged = None if target.staged is None else replace(
            target.staged, first_position=h.dst_pages.index(runs[0][1]) - h.cached_pages)
        return [KVPiece(self.link.region, target.region, runs, layers, target.heads, staged)]

    def _first_token(self, h: Handoff) -> FirstToken:
        sent = h.req.pages[h.cached_pages : len(h.dst_pages)]
        checksum = self.link.pages_checksum(sent) if h.kv_checksum else None
        return _first_token_record(h, checksum)

    def _runs_to_send(self, h: Handoff, upto_page: int) -> list:
        """Coalesced page runs from the first unsent page up to `upto_page`, now counted as sent."""
        start, h.pages_sent = h.pages_sent, max(h.pages_sent, upto_page)
        return coalesce_page_runs(h.req.pages[start:upto_page], h.dst_pages[start:upto_page])

    def _submit(self, h: Handoff, target: KVTarget, pieces: list[KVPiece], final: bool,
                computed: torch.cuda.Event | None, notify=None) -> None:
        """Every rank submits the same jobs (same code on the same state; a rank with no heads for a target writes
        nothing), so the room's writes in flight count one job per rank, and the results of all ranks' writers,
        which every rank receives (`step_events`), count them down together."""
        h.writes_in_flight += self.link.tp.size
        h.req.stage_marks.mark(KV_WRITES_ISSUED)
        self.writers.submit(WriteJob(h.room, target.session, pieces, final, computed, notify))

    def _record_event(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    # ---- control messages ---------------------------------------------------------------------------------

    def _on_transfer_request(self, msg: TransferRequest, arrived_at: float) -> None:
        room = msg.room
        h = self.link.handoffs.get(room)
        refused = self.early_requests.refusals.take(room) if h is None else None
        if refused is not None:
            self.link.send_control(msg.control, refused)
            return
        if h is None:
            if not self.early_requests.add(msg, self.link.clock()):
                logger.warning("room %d: dropping an early transfer_request for %d pages", room, len(msg.dst_pages))
            return
        if h.poll != KVPoll.BOOTSTRAPPING:
            return
        h.req.stage_marks.mark(BOOTSTRAP_RESOLVED, arrived_at)
        try:
            h.peer_control = msg.control
            check_compatible(self.link.description, msg.peer)
            layout = layout_from_description(msg.peer.get("kv_layout"))
            h.dst_pages = checked_pages(msg.dst_pages, layout.num_pages, prompt_pages(h, self.page_size))
            h.cached_pages = h.pages_sent = checked_cached_pages(msg.cached_pages, len(h.req.input_ids),
                                                                 self.page_size)
            h.peer_targets = self._targets(msg, layout)
            h.kv_checksum = msg.kv_checksum
        except (IncompatiblePeer, ValueError, TypeError, TransferError) as exc:
            logger.warning("room %d: refusing decode peer: %s", room, exc)
            self._fail(h, f"decode peer refused: {exc}", reason="peer_refused")
            return
        h.req.stage_marks.mark(DECODE_PAGES_KNOWN)
        h.advance(KVPoll.WAITING_FOR_INPUT)
        if msg.staging_offered:
            self.slot_asks.offer(room)
        if self.held_back.leave(h.room) is not None:  # the budget held it back: its decode has pages now
            self.scheduler.enqueue(h.req)
        self._push_computed(h)
        if h.prefilled:
            self.scheduler.report(h.req)  # its first token, held back until now (`holds_output`)

    def _targets(self, msg: TransferRequest, layout) -> list[KVTarget]:
        """The decode ranks of `msg`, each with the heads this rank writes into it."""
        targets, decode_tp = tp_targets(msg), msg.peer["tp_size"]  # check_compatible saw a positive int
        if len(targets) != decode_tp:
            raise ValueError(f"the decode runs {decode_tp} ranks but lists {len(targets)} transfer targets")
        if any(base <= 0 for _, base in targets):
            raise ValueError(f"bad kv_base in {targets[:8]!r}")
        tp = self.link.tp
        if msg.staging_offered and decode_tp != tp.size:
            raise ValueError(f"receive staging takes whole tokens: the decode runs TP {decode_tp}, the prefill {tp.size}")
        heads = self.link.model_config.num_kv_heads
        return [KVTarget(session, KVRegion(base, layout), head_slices(heads, tp.size, tp.rank, decode_tp, j))
                for j, (session, base) in enumerate(targets)]

    def _on_staging_slot(self, msg: StagingSlot, _arrived_at: float) -> None:
        """The decode's answer to the room's staging ask: its writes, waiting for it, go into the slot (or into the
        pages: none given). An answer that came after they began is dropped: `kv_done` tells the decode."""
        h = self.link.handoffs.get(msg.room)
        if h is None or not self.slot_asks.answered(msg.room):
            return
        try:
            staged = _staged_destinations(msg, len(h.peer_targets), len(h.dst_pages) - h.cached_pages)
        except ValueError as exc:
            logger.warning("room %d: refusing decode peer: %s", h.room, exc)
            self._fail(h, f"decode peer refused: {exc}", reason="peer_refused")
            return
        h.peer_targets = [replace(target, staged=slot) for target, slot in zip(h.peer_targets, staged)]
        self._push_computed(h)

    def _on_peer_abort(self, msg: Abort, _arrived_at: float) -> None:
        """The decode's reason and 4xx end the request, so that the client reads the same answer from either half:
        at once if it is here (its handoff began, or its grammar still compiles), else as soon as it comes."""
        error = "aborted by the decode server" + (f": {msg.error[:MAX_PEER_ERROR_CHARS]}" if msg.error else "")
        h = self.link.handoffs.get(msg.room)
        if h is not None:
            self._fail(h, error, reason="peer_aborted", status=peer_status(msg.status))
            return
        self._confirm_abort_of_unclaimed(msg.room)
        compiling = self._compiling(msg.room)
        if compiling is None:
            self.early_requests.aborts.put(msg.room, msg, self.link.clock())
        else:
            self.link.transfer_stats.failed("peer_aborted")
            self.scheduler.end(compiling, FinishReason("abort", message=error, status_code=peer_status(msg.status)))

    def _compiling(self, room: int) -> Req | None:
        """The request of `room`, a room without a handoff, that waits here for its grammar's compile, if any."""
        return next((r for r in self.scheduler.reqs.values() if r.bootstrap_room == room and not r.finished
                     and r.bootstrap_host != FAKE_BOOTSTRAP_HOST), None)

    def _confirm_abort_of_unclaimed(self, room: int) -> None:
        """An abort for a room known only by its early transfer_request (kept or dropped): nothing was written,
        nothing will be (the claim is forgotten), so the decode may free the pages it fenced."""
        control = self.early_requests.take_control(room)
        if control is not None:
            self.link.send_control(control, Failed(room, "the prefill never received the request"))

    def _on_write_done(self, msg: WriteDone) -> None:
        h = self.link.handoffs.get(msg.room)
        if h is None:
            return
        h.writes_in_flight -= msg.count
        self.link.transfer_stats.moved(msg.nbytes, msg.seconds)
        h.write_seconds += msg.seconds
        h.writes_landed_at = max(h.writes_landed_at, msg.landed_at)
        if h.poll == KVPoll.TRANSFERRING and h.writes_in_flight == 0:  # every rank's final write landed
            h.req.stage_marks.mark(KV_WRITES_LANDED, self._landing_time(h))
            kv_done = self.final_writes.due(h)
            if kv_done is not None:  # else the room's only writer has sent it
                self.link.send_control(h.peer_control, kv_done)
            h.advance(KVPoll.SUCCESS)
            self.link.transfer_stats.completed(h.write_seconds)
            self.scheduler.finish(h.req, FinishReason("length", message="KV handed to the decode server"))
        self._release_if_drained(h)

    def _landing_time(self, h: Handoff) -> float:
        """When the room's last write landed: as its writer saw it (its `kv_done` left then, when it is the room's
        only writer), not when this step read the result. With tensor parallelism a follower's clock may be
        another host's: the leader's clock as of this step then."""
        return h.writes_landed_at if self.link.tp.size == 1 else self.link.clock()

    def _on_write_failed(self, msg: WriteFailed) -> None:
        h = self.link.handoffs.get(msg.room)
        if h is not None:
            h.writes_in_flight -= msg.count
            self._fail(h, f"KV transfer to the decode server failed: {msg.error}", reason="write_failed")

    def _expire(self) -> None:
        """Fail the handoffs whose decode side did not claim them in time; drop late early requests; write the KV
        that waited too long for a staging answer."""
        t = self.link.clock()
        for h in self.link.bootstrap_queue():
            if t > h.deadline:
                self._fail(h, f"no decode server claimed bootstrap_room {h.room} within "
                              f"{self.args.disaggregation_bootstrap_timeout:.0f}s", reason="bootstrap_timeout",
                           status=PEER_TIMEOUT)
        self.early_requests.expire(t)
        for room in self.slot_asks.expired(t):  # no staging answer in time: into the pages
            self._push_computed(self.link.handoffs[room])

    def _fail(self, h: Handoff, error: str, reason: str, status: int | None = PEER_FAILED) -> None:
        """End the request (answered with HTTP `status`; None for a client's abort; `reason` labels the failure
        metric); pages stay held until no write for the room is in flight."""
        self.held_back.leave(h.room)
        self.slot_asks.drop(h.room)
        if h.poll != KVPoll.FAILED:
            self.link.transfer_stats.failed(reason)
            h.advance(KVPoll.FAILED, error)
            self.writers.cancelled.add(h.room)
            self.scheduler.end(h.req, FinishReason("abort", message=error, status_code=status))
        self._release_if_drained(h)  # also when a write of an already-failed handoff comes back

    def keeps_pages(self, req: Req) -> bool:
        h = self.link.handoff_of(req)
        return h is not None and h.writes_in_flight > 0

    def _release_if_drained(self, h: Handoff) -> None:
        if h.writes_in_flight > 0 or not h.req.finished or self.link.handoffs.get(h.room) is not h:
            return
        del self.link.handoffs[h.room]
        h.req.stage_marks.mark(HANDOFF_RELEASED)  # a success reports it: its request finished in this step
        self.final_writes.drop(h.room)
        self.writers.cancelled.discard(h.room)
        self.scheduler.release_pages(h.req)  # the handoff is gone: nothing keeps the pages now
        if h.poll == KVPoll.FAILED and h.peer_control is not None:
            self.link.send_control(h.peer_control, Failed(h.room, (h.error or "")[:MAX_STRING]))

    @property
    def warmup_bootstrap(self) -> dict:
        return {"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": 0}

    # ---- the scheduler process ----------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.link.handoffs)

    def idle_poll_ms(self) -> int:
        """Also: no later than when held writes stop waiting for their staging answer."""
        wait_s = self.slot_asks.seconds_left(self.link.clock())
        poll_ms = self.link.idle_poll_ms()
        return poll_ms if wait_s is None else min(poll_ms, math.ceil(wait_s * 1000))

    def wakeup_fds(self) -> list[int]:
        return [self.link.channel.wakeup_fd]

    def stats(self) -> dict:
        return {"kv_transfer": self.link.transfer_snapshot()}

    def queued_prefill_tokens(self) -> int:
        """Prompts held back until their decode side's destination pages come (the others are queued)."""
        return sum(len(h.req.all_ids) for h in self.held_back.handoffs())

    def server_info(self) -> dict:
        return {**self.link.server_info(), "bootstrap": self.bootstrap.address if self.bootstrap else None}

    def close(self) -> None:
        self.detach_link().close()

    def detach_link(self) -> PeerLink:
        """Stop the role's threads and its bootstrap server; the peer link stays open for the next role."""
        self.writers.close()
        if self.bootstrap is not None:
            self.bootstrap.close()
        return self.link


def _pages_known(h: Handoff) -> bool:
    """The decode side's page list came, and the handoff has not failed."""
    return h.poll in (KVPoll.WAITING_FOR_INPUT, KVPoll.TRANSFERRING)


def _staged_destinations(msg: StagingSlot, decode_tp: int, pages_to_write: int) -> list[StagedDestination | None]:
    """Each decode rank's receive-staging slot for the room (None for each: it gave none), checked: a positive
    address for every rank, sized for the pages the prefill writes."""
    if not msg.bases:
        return [None] * decode_tp
    if len(msg.bases) != decode_tp or any(ptr <= 0 for ptr in msg.bases):
        raise ValueError(f"receive staging {msg.bases[:8]!r} for {decode_tp} decode ranks")
    if msg.num_pages != pages_to_write:
        raise ValueError(f"receive staging of {msg.num_pages} pages for {pages_to_write} pages to write")
    return [StagedDestination(ptr, msg.num_pages) for ptr in msg.bases]


def _first_token_record(h: Handoff, kv_checksum: int | None) -> FirstToken:
    req = h.req
    return FirstToken(
        room=h.room,
        first_token=req.output_ids[0],
        logprob=req.output_logprobs[0] if req.output_logprobs else None,
        top_logprobs=[tuple(t) for t in req.output_top_logprobs[0]] if req.output_top_logprobs else None,
        kv_checksum=kv_checksum,
    )
