"""What both PD roles share, as a part each of them holds: the transfer engine, the control channel and one
`Handoff` per bootstrap room.

With tensor parallelism every rank runs its role's scheduler on its own KV heads, and all ranks must form the same
batches and free the same pages. The invariant, enforced by `step_events`: every control event (a peer's message,
a route lookup's end, a heartbeat verdict, a KV write's result on any rank) reaches every rank's handlers in the
same order at the same step, with the same time it became known, and every deadline is read against the same
clock (the leader's). Only the leader listens for peers, looks routes up, runs the heartbeat and sends control messages; each rank runs its own
transfer engine, which moves its own heads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgpack

from pdserve.config import ServerArgs
from pdserve.disagg.addressing import announced_host
from pdserve.cluster_auth import make_auth
from pdserve.disagg.control_channel import ControlChannel, Known
from pdserve.disagg.control_messages import Message, WriteDone, WriteFailed, from_wire, to_wire
from pdserve.disagg.kv_checksum import combined_checksum, head_checksums
from pdserve.disagg.handoff import Handoff, KVPoll, now
from pdserve.disagg.transfer import KVRegion, make_transfer_engine
from pdserve.disagg.transfer_stats import TransferStats
from pdserve.distributed.tensor_parallel import kv_head_start
from pdserve.engine.model_runner import ModelRunner
from pdserve.mem_cache.kv_pool import KVPool
from pdserve.models.model_config import ModelConfig
from pdserve.scheduler.request import Req
from pdserve.scheduler.role import IDLE_POLL_MS

logger = logging.getLogger(__name__)
WRITES_IN_FLIGHT_POLL_MS = 5


class PeerLink:
    """A PD role's link to its peers. It registers the KV pool with the transfer engine once and hands each step's
    control events to the role's handlers."""

    def __init__(self, args: ServerArgs, runner: ModelRunner):
        pool = runner.pool
        self.args = args
        self.model_config = runner.model_config
        self.pool = pool
        self.device = runner.device
        self.auth = make_auth(args.disaggregation_secret, args.api_key)
        if self.auth is None:
            logger.warning("no --disaggregation-secret or --api-key: the bootstrap server, control channel and KV transfer port "
                           "accept any peer that reaches them; they bind %s like the HTTP server", args.host)
        self.engine = make_transfer_engine(
            args.disaggregation_transfer_backend, str(self.device), args.disaggregation_ib_device, host=args.host,
            timeout_s=args.disaggregation_waiting_timeout, auth=self.auth,
            advertise_host=announced_host(args.host, args.disaggregation_advertise_host),
        )
        self.engine.register(pool.data_ptr, pool.nbytes, str(self.device))
        self.region = KVRegion(pool.data_ptr, pool.layout)
        self.tp = runner.tp
        self.leader_clock = now()  # the leader's clock as of the last step (see `clock`)
        self.channel = ControlChannel(args.host, f"pd-{args.disaggregation_mode}", self.auth, listen=self.tp.is_leader)
        self.description = peer_description(args, self.model_config, pool, self.engine.name)
        self.handoffs: dict[int, Handoff] = {}
        self.transfer_stats = TransferStats(args.disaggregation_mode, args.disaggregation_link_gbps)
        self._kept: dict[str, object] = {}  # buffers a role registered with the engine (`kept`)
        logger.info("KV transfer backend %s over %s; control endpoint %s", self.engine.name,
                    self.engine.transport(), self.channel.endpoint)

    def kept(self, name: str, make: Callable[[], object]) -> object:
        """The buffer `name` made by `make` once: what a role registers with the engine stays registered for the
        engine's life, and a role switch hands the link (and so it) to the next role of that kind."""
        if name not in self._kept:
            self._kept[name] = make()
        return self._kept[name]

    def serve_role(self, args: ServerArgs) -> None:
        """The link now serves the role `args` names (a role switch): peers keep reaching the same endpoints, the
        transfer counters start over under the new role."""
        self.args = args
        self.transfer_stats = TransferStats(args.disaggregation_mode, args.disaggregation_link_gbps)

    def handoff_of(self, req: Req) -> Handoff | None:
        """The handoff of this request (a fake-transfer request has none, whatever its room)."""
        h = self.handoffs.get(req.bootstrap_room)
        return h if h is not None and h.req is req else None

    def bootstrap_queue(self) -> list[Handoff]:
        """The handoffs still waiting for their peer (BOOTSTRAPPING), oldest first."""
        return [h for h in self.handoffs.values() if h.poll == KVPoll.BOOTSTRAPPING]

    def transfer_snapshot(self) -> dict:
        """The transfer counters with the length of each queue (`kv_transfer` of the stats)."""
        polls = [h.poll for h in self.handoffs.values()]
        queues = {"bootstrap": polls.count(KVPoll.BOOTSTRAPPING),
                  "transfer": polls.count(KVPoll.WAITING_FOR_INPUT) + polls.count(KVPoll.TRANSFERRING)}
        return self.transfer_stats.snapshot(queues)

    def idle_poll_ms(self) -> int:
        """A follower's KV write result has no fd the leader polls: it reaches the leader at the next step's
        gather, so while writes are in flight with tensor parallelism the leader looks again soon."""
        if self.tp.size > 1 and any(h.writes_in_flight for h in self.handoffs.values()):
            return WRITES_IN_FLIGHT_POLL_MS
        return IDLE_POLL_MS

    def handle_events(self, peer_handlers: dict[type[Message], Callable[[Message, float], None]],
                      completion_handlers: dict[type[Message], Callable[[Message], None]]) -> None:
        """Runs this step's control events (`step_events`) in the order they became known: a peer's message through
        the role's peer handler of its type, with the time it arrived (a stage it ends is marked then); a helper
        thread's result through the completion handler of its type."""
        for known in self.step_events():
            msg = known.msg
            handler = (peer_handlers if msg.remote else completion_handlers).get(type(msg))
            if handler is None:
                logger.warning("ignoring control message %s: this role does not handle it", msg.tag)
            elif msg.remote:
                handler(msg, known.at)
            else:
                handler(msg)

    def step_events(self) -> list[Known]:
        """This step's control events, the same list on every rank: the leader's (peers' messages, its route
        lookups and heartbeat verdicts, its KV writes' results, as they became known), then each follower's (its KV
        writes' results only), gathered in one collective over the CPU group together with the leader's clock."""
        drained = self.channel.drain()
        local = sorted([*drained.from_peers, *drained.completions], key=lambda known: known.at)
        if self.tp.size == 1:
            return local
        if not self.tp.is_leader and any(not isinstance(k.msg, (WriteDone, WriteFailed)) for k in local):
            raise RuntimeError(f"a follower rank's inbox holds {[k.msg.tag for k in local]}: only the leader talks "
                               "to peers")
        payload = msgpack.packb([now(), [[k.at, to_wire(k.msg)] for k in local]], use_bin_type=True)
        gathered = [msgpack.unpackb(p, raw=False) for p in self.tp.all_gather_bytes(payload)]
        self.leader_clock = gathered[0][0]
        return [Known(from_wire(wire, remote=False), at) for _, events in gathered for at, wire in events]

    def clock(self) -> float:
        """The time every deadline is set and read with: a single rank's own, the leader's as of this step with
        tensor parallelism (so that every rank expires the same handoffs at the same step)."""
        return now() if self.tp.size == 1 else self.leader_clock

    def pages_checksum(self, pages: list[int]) -> int:
        """The KV checksum of `pages` over the model's every head; with tensor parallelism one collective joins
        the ranks' heads, so every rank must call it at the same step."""
        cfg = self.model_config
        mine = head_checksums(self.pool, pages, kv_head_start(cfg.num_kv_heads, self.tp.size, self.tp.rank))
        per_head = {}
        for raw in self.tp.all_gather_bytes(msgpack.packb(list(mine.items()))):
            per_head.update(dict(msgpack.unpackb(raw)))
        return combined_checksum(per_head)

    def send_control(self, endpoint: str, msg: Message) -> None:
        """To a peer's control endpoint; the followers send nothing (the leader speaks for all ranks)."""
        if self.tp.is_leader:
            self.channel.send(endpoint, msg)

    def server_info(self) -> dict:
        return {"disaggregation_mode": self.args.disaggregation_mode, "transfer_backend": self.engine.name,
                "transport": self.engine.transport(), "session": self.engine.session_id(),
                "control_endpoint": self.channel.endpoint}

    def close(self) -> None:
        self.channel.close()
        self.engine.close()


def model_fingerprint(cfg: ModelConfig) -> str:
    return (f"{cfg.architecture} layers={cfg.num_layers} hidden={cfg.hidden_size} heads={cfg.num_heads}/"
            f"{cfg.num_kv_heads} vocab={cfg.vocab_size}")


def peer_description(args: ServerArgs, cfg: ModelConfig, pool: KVPool, backend: str) -> dict:
    """The fields both sides must agree on (see bootstrap.check_compatible); `kv_layout` is this rank's pool plus
    the model's KV head count, so that a peer with another TP size can map heads to ranks."""
    return {"model": model_fingerprint(cfg), "tp_size": args.tp_size, "transfer_backend": backend,
            "kv_layout": {**pool.layout.describe(), "total_kv_heads": cfg.num_kv_heads}}
