"""How every process of a server starts and ends: its logging, a child's set-up (its name, signals, dying with its
parent), an exit without interpreter teardown, and how a parent stops its children."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.process import BaseProcess
from typing import NoReturn

from pdserve.tqdm_lock import no_process_shared_locks

LOG_FORMAT = "%(asctime)s %(levelname)s [%(processName)s] %(name)s: %(message)s"
PARENT_POLL_SECONDS = 1.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
TERMINATE_TIMEOUT_SECONDS = 10.0
KILL_TIMEOUT_SECONDS = 5.0

logger = logging.getLogger(__name__)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)
    logging.getLogger("torch").setLevel(max(logging.WARNING, logging.getLogger().level))


def child_setup(role: str, log_level: str) -> None:
    """Common start of every child: logging, leave Ctrl-C to the parent, die with the parent."""
    import multiprocessing

    multiprocessing.current_process().name = role
    setup_logging(log_level)
    no_process_shared_locks()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: exit_now(0))
    parent = os.getppid()
    _die_with_parent()
    threading.Thread(target=_exit_when_orphaned, args=(parent, role), daemon=True, name="parent-watch").start()


def _die_with_parent() -> None:
    """Ask the kernel for SIGKILL when the server process dies, even by kill -9 while this process is stuck in
    native code: no child outlives it holding ports or device memory. The parent-watch thread covers other OSes."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())


def _exit_when_orphaned(parent_pid: int, role: str) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_SECONDS)
    logger.error("%s: the server process died; exiting", role)
    os._exit(1)


def exit_now(code: int) -> NoReturn:
    """Exit without interpreter teardown: garbage-collecting torch's module graph takes seconds.

    Every process of the server holds only sockets and memory at exit; nothing needs flushing but logs.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stop_children(children: list[BaseProcess]) -> None:
    """SIGTERM to every child still alive, then join each and kill the ones that did not stop in time."""
    for child in children:
        if child.is_alive():
            child.terminate()
    for child in children:
        if child.pid is None:
            continue
        child.join(TERMINATE_TIMEOUT_SECONDS)
        if child.is_alive():
            logger.warning("the %s process did not stop in time; killing it", child.name)
            child.kill()
            child.join(KILL_TIMEOUT_SECONDS)
