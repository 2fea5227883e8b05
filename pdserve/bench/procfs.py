"""Processes of a local deployment from /proc (Linux): who listens on a port, their descendants, RSS and open fds."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TCP_LISTEN = "0A"
CMDLINE_CHARS = 160


@dataclass(frozen=True, slots=True)
class ProcessSample:
    pid: int
    cmdline: str
    rss_kb: int | None  # None: the process is gone or unreadable
    open_fds: int | None


def listening_pid(port: int) -> int | None:
    """The process holding a listening TCP socket on `port` (IPv4 or IPv6), if this user can see it."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    for pid in _pids():
        try:
            for fd in (PROC / str(pid) / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    return pid
        except OSError:
            continue
    return None


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == TCP_LISTEN:
                inodes.add(f"socket:[{fields[9]}]")
    return inodes


def _pids() -> list[int]:
    return [int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit()]


def parent_of(pid: int) -> int | None:
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces


def with_descendants(roots: list[int]) -> list[int]:
    """`roots` and every process below them (a server's scheduler and detokenizer processes)."""
    children: dict[int, list[int]] = {}
    for pid in _pids():
        if (parent := parent_of(pid)) is not None:
            children.setdefault(parent, []).append(pid)
    found, stack = [], list(roots)
    while stack:
        pid = stack.pop()
        if pid not in found:
            found.append(pid)
            stack.extend(children.get(pid, []))
    return found


def cmdline(pid: int) -> str | None:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None


def matching(substring: str) -> list[int]:
    """Processes whose command line contains `substring` (this process excluded)."""
    own = os.getpid()
    return [pid for pid in _pids() if pid != own and substring in (cmdline(pid) or "")]


def sample(pid: int) -> ProcessSample:
    base = PROC / str(pid)
    try:
        status = dict(line.split(":", 1) for line in (base / "status").read_text().splitlines() if ":" in line)
        rss = int(status["VmRSS"].split()[0])
        return ProcessSample(pid, (cmdline(pid) or "")[:CMDLINE_CHARS], rss, len(list((base / "fd").iterdir())))
    except (OSError, KeyError, ValueError):
        return ProcessSample(pid, "", None, None)
