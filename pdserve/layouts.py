"""Deployment layouts on a machine's GPUs, by name, and the one `launch_cluster --layout auto` starts.

Names: `colocated` (one plain server per GPU behind the regular router), `XpYd` (X prefill and Y decode servers
behind the PD router, e.g. 1p1d, 1p3d, 2p2d, 3p1d), `XpYd-balanced`: the same with the decode servers taking
prefill work within a TPOT budget and the router choosing local or remote prefill per request from measured load,
and a `-roles` ending (`2p2d-roles`, `2p2d-balanced-roles`): every server may switch role without a restart, the
router moving one to the busy side when the other idles (the automatic P:D balance).

`auto` picks from MEASURED_BEST, which holds what `python -m pdserve.bench.sweep` measured best for a workload on a
GPU count (the sweep prints the entry to add); where nothing was measured, half the GPUs prefill and the rest decode,
balanced. Torch-free: the launcher parses layouts before anything starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

WORKLOADS = ("mix", "chat", "docs")  # pdserve.bench.serving's mix, its chat part alone, its documents alone
BALANCED_SUFFIX = "-balanced"
# What makes a PD layout balanced: the router's load-aware choice of local (decode-side) or remote prefill, and each
# decode server's prefill work kept within a TPOT budget (its value: the launcher's --decode-tpot-budget-ms).
BALANCED_ROUTER_FLAGS = ("--local-prefill-by-load",)
DECODE_TPOT_BUDGET_FLAG = "--decode-tpot-budget-ms"
ROLES_SUFFIX = "-roles"
# What lets the P:D ratio follow the load: every PD server switchable (a decode one with its own bootstrap port, for
# the day it prefills), the router's balance switching them.
ROLE_SWITCH_SERVER_FLAG = "--enable-pd-role-switch"
ROLE_BALANCE_ROUTER_FLAGS = ("--balance-roles",)
_PD_NAME = re.compile(r"([1-9]\d*)p([1-9]\d*)d(-balanced)?(-roles)?")


class LayoutError(ValueError):
    """A layout name that means nothing, or one that does not fit the GPUs."""


@dataclass(frozen=True, slots=True)
class Layout:
    """Server counts of a layout on a machine: `workers` colocated servers, or `prefill` + `decode` PD servers."""

    name: str
    workers: int = 0
    prefill: int = 0
    decode: int = 0
    balanced: bool = False
    switch_roles: bool = False

    @property
    def colocated(self) -> bool:
        return self.workers > 0

    @property
    def servers(self) -> int:
        return self.workers + self.prefill + self.decode

    def describe(self) -> str:
        if self.colocated:
            return f"{self.workers} colocated server{'s' if self.workers > 1 else ''}"
        extras = [", decode servers prefill within their TPOT budget, chosen by load"] if self.balanced else []
        extras += [", roles switch with the load"] if self.switch_roles else []
        return f"{self.prefill} prefill + {self.decode} decode{''.join(extras)}"


def parse_layout(name: str, slots: int) -> Layout:
    """The layout `name` on `slots` server slots (GPUs): `colocated` fills them all, `XpYd` has X + Y servers
    whatever the slots (`fits` says whether they fit)."""
    if name == "colocated":
        return Layout(name, workers=max(1, slots))
    match = _PD_NAME.fullmatch(name)
    if match is None:
        raise LayoutError(f"unknown layout {name!r}: colocated, XpYd (e.g. 1p1d, 2p2d), XpYd{BALANCED_SUFFIX}, "
                          f"XpYd{ROLES_SUFFIX} or XpYd{BALANCED_SUFFIX}{ROLES_SUFFIX}")
    return Layout(name, prefill=int(match[1]), decode=int(match[2]), balanced=match[3] is not None,
                  switch_roles=match[4] is not None)


def plain_layout(name: str) -> str:
    """`name` without its -balanced and -roles endings."""
    match = _PD_NAME.fullmatch(name)
    return f"{match[1]}p{match[2]}d" if match else name


def check_fits(layout: Layout, gpus: int) -> None:
    """LayoutError unless `layout`'s servers have a GPU each (one GPU is shared by every server)."""
    if gpus > 1 and layout.servers > gpus:
        raise LayoutError(f"layout {layout.name} needs {layout.servers} GPUs, {gpus} given")


def check_layout_name(name: str) -> str:
    """`name` if it is a layout's name (whether it fits is checked when the GPUs are known)."""
    parse_layout(name, slots=1)
    return name


@dataclass(frozen=True, slots=True)
class Measured:
    layout: str
    why: str  # the measurement, in words: goodputs against colocated's, SLO, machine, date


# (workload, GPUs) -> the layout with the highest goodput in a `pdserve.bench.sweep` run (its JSON's `auto_entry`).
MEASURED_BEST: dict[tuple[str, int], Measured] = {
    ("mix", 2): Measured("1p1d-balanced", "goodput 10.3 req/s (interpolated, mean of 2 repeats); colocated 5.9 req/s; "
                         "TTFT <= 1000 ms, TPOT <= 10 ms, NVIDIA H200, 2026-11-28"),
    ("mix", 4): Measured("3p1d", "goodput 22.0 req/s (interpolated); colocated 14.3 req/s, 2p2d-balanced 20.7 req/s, "
                         "2p2d-balanced-roles 20.7 req/s, 1p3d-balanced 15.3 req/s; TTFT <= 1000 ms, TPOT <= 10 ms, "
                         "NVIDIA H200, 2026-11-28"),
}


def default_layout(gpus: int) -> str:
    """Half the GPUs prefill (the mix is ~75% prefill work), the others decode and help with prefill; from three
    GPUs on, one side has a server to spare, so the roles follow the load."""
    prefill = max(1, gpus // 2)
    return f"{prefill}p{gpus - prefill}d{BALANCED_SUFFIX}{ROLES_SUFFIX if gpus > 2 else ''}"


def choose_layout(workload: str, gpus: int) -> tuple[str, str]:
    """The layout `auto` starts for `workload` on `gpus` GPUs, and why, in words."""
    if gpus < 2:
        return "1p1d", "fewer than two GPUs: the launcher's default pair"
    measured = MEASURED_BEST.get((workload, gpus))
    if measured is not None:
        return measured.layout, f"measured best: {measured.why}"
    roles = ", and a server of the idle side switches role when the other side's queue stays long" if gpus > 2 else ""
    return default_layout(gpus), ("not measured yet, the default: half the GPUs prefill, the decode servers take "
                                  f"prefill work within their TPOT budget when the prefill queue is long{roles}")
