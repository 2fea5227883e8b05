"""What both PD roles share: the transfer engine, the control channel and one `Handoff` per bootstrap room."""

from __future__ import annotations

import logging
from abc import ABCMeta, abstractmethod
from collections.abc import Callable

from pdserve.config import ServerArgs
from pdserve.disagg.addressing import announced_host
from pdserve.disagg.auth import make_auth
from pdserve.disagg.control_channel import ControlChannel
from pdserve.disagg.control_messages import Message
from pdserve.disagg.protocol import Handoff, KVPoll, validate_pd_request
from pdserve.disagg.transfer import KVRegion, make_transfer_engine
from pdserve.disagg.transfer_stats import TransferStats
from pdserve.mem_cache.kv_pool import KVPool
from pdserve.models.model_config import ModelConfig
from pdserve.scheduler.request import Req
from pdserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class DisaggScheduler(Scheduler, metaclass=ABCMeta):
    """A PD role's scheduler. It registers the KV pool with the transfer engine once, runs the peers' control
    messages through `handlers` and expires late handoffs before each step."""

    allows_local_prefill = False  # the decode role also prefills requests sent without a prefill peer

    def __init__(self, args: ServerArgs, tokenizer=None):
        super().__init__(args, tokenizer)
        pool = self.runner.pool
        self.auth = make_auth(args.disaggregation_secret)
        if self.auth is None:
            logger.warning("no --disaggregation-secret: the bootstrap server, control channel and KV transfer port "
                           "accept any peer that reaches them; they bind %s like the HTTP server", args.host)
        self.engine = make_transfer_engine(
            args.disaggregation_transfer_backend, str(self.device), args.disaggregation_ib_device, host=args.host,
            timeout_s=args.disaggregation_waiting_timeout, auth=self.auth,
            advertise_host=announced_host(args.host, args.disaggregation_advertise_host),
        )
        self.engine.register(pool.data_ptr, pool.nbytes, str(self.device))
        self.region = KVRegion(pool.data_ptr, pool.layout)
        self.channel = ControlChannel(args.host, f"pd-{args.disaggregation_mode}", self.auth)
        self.description = peer_description(args, self.model_config, pool, self.engine.name)
        self.handoffs: dict[int, Handoff] = {}
        self.handlers: dict[type[Message], Callable] = {}
        self.transfer_stats = TransferStats(args.disaggregation_mode)
        logger.info("KV transfer backend %s over %s; control endpoint %s", self.engine.name,
                    self.engine.transport(), self.channel.endpoint)

    def validate(self, req: Req) -> None:
        super().validate(req)
        validate_pd_request(req, self.handoffs, self.allows_local_prefill)

    def has_work(self) -> bool:
        return super().has_work() or bool(self.handoffs)

    def handoff_of(self, req: Req) -> Handoff | None:
        """The handoff of this request (a fake-transfer request has none, whatever its room)."""
        h = self.handoffs.get(req.bootstrap_room)
        return h if h is not None and h.req is req else None

    def bootstrap_queue(self) -> list[Handoff]:
        """The handoffs still waiting for their peer (BOOTSTRAPPING), oldest first."""
        return [h for h in self.handoffs.values() if h.poll == KVPoll.BOOTSTRAPPING]

    def stats(self) -> dict:
        polls = [h.poll for h in self.handoffs.values()]
        queues = {"bootstrap": polls.count(KVPoll.BOOTSTRAPPING),
                  "transfer": polls.count(KVPoll.WAITING_FOR_INPUT) + polls.count(KVPoll.TRANSFERRING)}
        return {**super().stats(), "kv_transfer": self.transfer_stats.snapshot(queues)}

    def wakeup_fds(self) -> list[int]:
        return [self.channel.wakeup_fd]

    def prepare_step(self) -> bool:
        self.channel.dispatch(self.handlers)
        self.expire_handoffs()
        return True

    @abstractmethod
    def expire_handoffs(self) -> None:
        """Fail the handoffs whose deadline passed (each role has its own deadlines)."""

    @property
    def model_info(self) -> dict:
        return {**super().model_info, **self.server_info()}

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
    """The fields both sides must agree on (see bootstrap.check_compatible)."""
    return {"model": model_fingerprint(cfg), "tp_size": args.tp_size, "transfer_backend": backend,
            "kv_layout": pool.layout.describe()}
