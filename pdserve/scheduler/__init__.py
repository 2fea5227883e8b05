"""Continuous-batching schedulers: colocated, and the prefill/decode roles of PD disaggregation."""

from __future__ import annotations


def create_scheduler(args, tokenizer=None):
    """The scheduler for `args.disaggregation_mode` (null: colocated, prefill, decode)."""
    if args.disaggregation_mode == "prefill":
        from pdserve.disagg.prefill import PrefillScheduler

        return PrefillScheduler(args, tokenizer)
    if args.disaggregation_mode == "decode":
        from pdserve.disagg.decode import DecodeScheduler

        return DecodeScheduler(args, tokenizer)
    from pdserve.scheduler.scheduler import Scheduler

    return Scheduler(args, tokenizer)
