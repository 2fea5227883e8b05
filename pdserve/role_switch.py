"""A PD server changes role in place (`--enable-pd-role-switch`, `POST /pd_role_switch`): the scheduler process
replaces its scheduler by one of the other role on the same model runner, KV pool and peer link, with no weight
reload. The HTTP side has drained the server first and `SchedulerProcess` checked that nothing is in flight and
every page is free.

The peer link (transfer engine, control channel) and the buffers registered with its engine are kept, so the
server's control endpoint and transfer session stay the same across switches: a decode peer that cached its
route as a prefill finds it valid again when it becomes a prefill once more. The prefix cache starts empty.

It sits with `scheduler_main.py` above `pdserve/scheduler/` and `pdserve/disagg/`: it assembles both.
"""

from __future__ import annotations

import logging
import time

from pdserve.config import ServerArgs
from pdserve.disagg.factory import scheduler_for
from pdserve.disagg.peer_link import PeerLink
from pdserve.engine import compile_watch
from pdserve.engine.model_runner import ModelRunner
from pdserve.scheduler.role import Role
from pdserve.scheduler.scheduler import Scheduler
from pdserve.scheduler.warmup import warm_up

logger = logging.getLogger(__name__)
PD_ROLES = ("prefill", "decode")


def switch_role(scheduler: Scheduler, args: ServerArgs, mode: str) -> tuple[Scheduler, str | None]:
    """A scheduler of role `mode` and None; or, when that role cannot start (its bootstrap port is taken, its
    warm-up fails), one of the old role again and why. `scheduler` (idle, every page free) is closed unless `mode` is no other PD role;
    `args`: the server's flags as launched."""
    old_mode = scheduler.args.disaggregation_mode
    if mode not in PD_ROLES or mode == old_mode:
        return scheduler, f"cannot switch from {old_mode} to {mode!r}: the roles are {', '.join(PD_ROLES)}"
    started = time.monotonic()
    runner, link = scheduler.runner, _close_keeping_link(scheduler)
    try:
        switched = _start_role(args.replace(disaggregation_mode=mode), runner, link)
    except Exception as exc:  # whatever stopped the new role, the server goes on in its old one (or exits if not)
        logger.exception("the switch from %s to %s failed; staying %s", old_mode, mode, old_mode)
        return _start_role(args.replace(disaggregation_mode=old_mode), runner, link), f"{type(exc).__name__}: {exc}"
    logger.info("switched role from %s to %s in %.2f s", old_mode, mode, time.monotonic() - started)
    return switched, None


def _start_role(args: ServerArgs, runner: ModelRunner, link: PeerLink) -> Scheduler:
    link.serve_role(args)
    scheduler = scheduler_for(args, runner, link)
    if args.skip_server_warmup:
        return scheduler
    try:
        with compile_watch.warming_up():
            warm_up(scheduler)  # a server that started as decode has compiled no prefill kernel yet
    except BaseException:
        _close_keeping_link(scheduler)  # its bootstrap port free again for the old role
        raise
    return scheduler


def _close_keeping_link(scheduler: Scheduler) -> PeerLink:
    """Close an idle PD scheduler but for its peer link, which the next role takes over."""
    link = scheduler.role.detach_link()
    scheduler.role = Role()  # the old role's threads have stopped: closing the scheduler must not close the link
    scheduler.close()
    return link
