"""Builds a server's scheduler: its model runner and its role, colocated or the prefill or decode side of PD."""

from __future__ import annotations

from pdserve.config import ServerArgs
from pdserve.disagg.decode import DecodeRole, decode_scheduler_args
from pdserve.disagg.prefill import PrefillRole
from pdserve.engine.model_runner import load_runner
from pdserve.scheduler.scheduler import Scheduler


def create_scheduler(args: ServerArgs, tokenizer=None) -> Scheduler:
    """The scheduler for `args.disaggregation_mode` (null: colocated, prefill, decode)."""
    runner = load_runner(args)
    if args.disaggregation_mode == "prefill":
        return Scheduler(args, runner, PrefillRole(args, runner), tokenizer)
    if args.disaggregation_mode == "decode":
        args = decode_scheduler_args(args)
        return Scheduler(args, runner, DecodeRole(args, runner), tokenizer)
    return Scheduler(args, runner, tokenizer=tokenizer)
