"""The scheduler child process's entry point: builds the scheduler with its role, warms it up, runs its loop.

It sits above `pdserve/scheduler/` and `pdserve/disagg/` because it assembles both (the role its flags name, by
`pdserve/disagg/factory.py`, inside the scheduler `pdserve/scheduler/process.py` serves), so that the scheduler
package never imports the PD package it hosts.
"""

from __future__ import annotations

import logging
import sys

from pdserve.config import ConfigError, ServerArgs
from pdserve.process_setup import child_setup, exit_now

logger = logging.getLogger(__name__)

EXIT_CONFIG_ERROR = 2


def run_scheduler_process(args: ServerArgs) -> None:
    """Entry point of a scheduler child, one per tensor-parallel rank (spawned by `server/serve.py`, and for the
    ranks after 0 by the offline `LLM`)."""
    child_setup(scheduler_process_name(args.tp_rank), args.log_level)
    from pdserve.disagg.factory import create_scheduler  # the engine loads in the child only, not where it is spawned
    from pdserve.distributed.tensor_parallel import GroupClosed
    from pdserve.scheduler.process import SchedulerProcess
    from pdserve.role_switch import switch_role
    from pdserve.scheduler.warmup import warm_up

    try:
        scheduler = create_scheduler(args)
    except ConfigError as exc:  # a flag only the model can refute: one line, not a traceback
        logger.error("%s", exc)
        sys.exit(EXIT_CONFIG_ERROR)
    warmup = None if args.skip_server_warmup else warm_up(scheduler)  # before ready: /health answers after it
    try:
        SchedulerProcess(args, scheduler, switch_role if args.enable_pd_role_switch else None).run_forever(warmup)
    except GroupClosed:  # a follower rank of the offline LLM, which closed the group on shutdown
        exit_now(0)


def scheduler_process_name(tp_rank: int) -> str:
    return "scheduler" if tp_rank == 0 else f"scheduler-tp{tp_rank}"
