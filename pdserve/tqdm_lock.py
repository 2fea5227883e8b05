"""tqdm's lock for its progress bars: a thread lock, not a multiprocessing semaphore."""

from __future__ import annotations

import threading


def no_process_shared_locks() -> None:
    """The server's processes end with `os._exit` (`exit_now`), so a multiprocessing semaphore made in one is never
    unlinked and Python's resource tracker warns "leaked semaphore objects" at shutdown. tqdm makes one for its
    first progress bar (the weight loader's) unless it was given a lock: give it a thread lock."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
