"""Builds a server's scheduler: its model runner and its role, colocated or the prefill or decode side of PD."""

from __future__ import annotations

from pdserve.config import ServerArgs
from pdserve.disagg.decode import DecodeRole, decode_scheduler_args
from pdserve.disagg.peer_link import PeerLink
from pdserve.disagg.prefill import PrefillRole
from pdserve.engine.model_runner import ModelRunner, load_runner
from pdserve.scheduler.scheduler import Scheduler


def create_scheduler(args: ServerArgs, tokenizer=None) -> Scheduler:
    """The scheduler for `args.disaggregation_mode` (null: colocated, prefill, decode)."""
    return scheduler_for(args, load_runner(args), tokenizer=tokenizer)


def scheduler_for(args: ServerArgs, runner: ModelRunner, link: PeerLink | None = None, tokenizer=None) -> Scheduler:
    """The scheduler of `args`' role on a loaded runner; a PD role takes over `link` when given (a role switch)."""
    if args.disaggregation_mode == "prefill":
        return Scheduler(args, runner, PrefillRole(args, runner, link), tokenizer)
    if args.disaggregation_mode == "decode":
        args = decode_scheduler_args(args)
        return Scheduler(args, runner, DecodeRole(args, runner, link), tokenizer)
    return Scheduler(args, runner, tokenizer=tokenizer)
