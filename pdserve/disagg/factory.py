"""Picks the scheduler of a server's role: colocated, or the prefill or decode side of PD disaggregation."""

from __future__ import annotations

from pdserve.config import ServerArgs
from pdserve.disagg.decode import DecodeScheduler
from pdserve.disagg.prefill import PrefillScheduler
from pdserve.scheduler.scheduler import Scheduler


def create_scheduler(args: ServerArgs, tokenizer=None) -> Scheduler:
    """The scheduler for `args.disaggregation_mode` (null: colocated, prefill, decode)."""
    if args.disaggregation_mode == "prefill":
        return PrefillScheduler(args, tokenizer)
    if args.disaggregation_mode == "decode":
        return DecodeScheduler(args, tokenizer)
    return Scheduler(args, tokenizer)
