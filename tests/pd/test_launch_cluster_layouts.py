"""`launch_cluster --layout` on N GPUs, without starting anything: which layout `auto` picks for a workload and GPU
count (measured, else the default), the one line that says so, and the command lines of every server and the
router for colocated, XpYd and -balanced layouts; bad layouts are refused before anything starts."""

from __future__ import annotations

import pytest

from pdserve import layouts
from pdserve.launch_cluster import LaunchConfigError, parse_args, plan_layout
from pdserve.layouts import BALANCED_ROUTER_FLAGS, DECODE_TPOT_BUDGET_FLAG, LayoutError, Measured, parse_layout
from pdserve.server_processes import ClusterError


def planned(model: str, visible: int, *flags: str):
    ns, engine_args = parse_args(["--model-path", model, *flags, "--", "--page-size", "16"])
    return plan_layout(ns, engine_args, visible)


def flag_value(argv, name: str) -> str | None:
    values = [argv[i + 1] for i, arg in enumerate(argv) if arg == name]
    return values[-1] if values else None


def router_urls(argv, name: str) -> list[str]:
    """The URLs after `--prefill`, `--decode` or `--worker`, up to the next flag."""
    start = argv.index(name) + 1
    end = next((i for i in range(start, len(argv)) if argv[i].startswith("--")), len(argv))
    return list(argv[start:end])


def test_auto_on_two_gpus_starts_one_balanced_prefill_decode_pair_and_says_why_in_one_line(tiny_model):
    plan = planned(tiny_model, 2)
    assert plan.layout_line.startswith("--layout auto on 2 GPUs for the mix workload: 1p1d-balanced (")
    assert "measured best: goodput 10.3 req/s" in plan.layout_line and "\n" not in plan.layout_line
    assert [(s.name, s.gpu) for s in plan.servers] == [("prefill 0", 0), ("decode 0", 1)]
    prefill, decode = plan.servers
    assert flag_value(prefill.argv, "--disaggregation-mode") == "prefill"
    assert flag_value(prefill.argv, DECODE_TPOT_BUDGET_FLAG) is None
    assert flag_value(decode.argv, "--disaggregation-mode") == "decode"
    assert flag_value(decode.argv, DECODE_TPOT_BUDGET_FLAG) == "8.5"
    assert all(f in plan.router.argv for f in BALANCED_ROUTER_FLAGS)
    assert router_urls(plan.router.argv, "--prefill") == [prefill.url]
    assert router_urls(plan.router.argv, "--decode") == [decode.url]


def test_auto_takes_the_measured_best_layout_of_the_declared_workload(tiny_model, monkeypatch):
    monkeypatch.setattr(layouts, "MEASURED_BEST", {("mix", 4): Measured("1p3d", "goodput 20 vs 12 req/s"),
                                                   ("docs", 4): Measured("3p1d-balanced", "goodput 9 vs 6 req/s")})
    plan = planned(tiny_model, 4)
    assert plan.layout_line.endswith("1p3d (1 prefill + 3 decode); measured best: goodput 20 vs 12 req/s")
    assert [s.name for s in plan.servers] == ["prefill 0", "decode 0", "decode 1", "decode 2"]
    assert not any(f in plan.router.argv for f in BALANCED_ROUTER_FLAGS)
    docs = planned(tiny_model, 4, "--workload", "docs", "--decode-tpot-budget-ms", "12.5")
    assert "for the docs workload: 3p1d-balanced" in docs.layout_line
    assert [s.gpu for s in docs.servers] == [0, 1, 2, 3]
    assert flag_value(docs.servers[-1].argv, DECODE_TPOT_BUDGET_FLAG) == "12.5"
    chat = planned(tiny_model, 4, "--workload", "chat")  # nothing measured: half the GPUs prefill, roles follow
    assert "for the chat workload: 2p2d-balanced-roles (" in chat.layout_line


def test_a_roles_layout_makes_every_server_switchable_and_the_router_balance_them(tiny_model):
    plan = planned(tiny_model, 4, "--layout", "1p3d-roles")
    assert plan.layout_line == "--layout 1p3d-roles on 4 GPUs: 1 prefill + 3 decode, roles switch with the load"
    assert all(layouts.ROLE_SWITCH_SERVER_FLAG in s.argv for s in plan.servers)
    boots = [flag_value(s.argv, "--disaggregation-bootstrap-port") for s in plan.servers]
    assert all(b and b.isdigit() for b in boots) and len(set(boots)) == 4  # a decode may become a prefill
    assert [s.bootstrap_port for s in plan.servers] == [int(b) for b in boots]
    assert all(f in plan.router.argv for f in layouts.ROLE_BALANCE_ROUTER_FLAGS)
    assert not any(f in plan.router.argv for f in BALANCED_ROUTER_FLAGS)
    assert flag_value(plan.router.argv, "--prefill-bootstrap-ports") == boots[0]
    balanced = planned(tiny_model, 4, "--layout", "2p2d-balanced-roles")  # a prefill that turns decode keeps a budget
    assert all(flag_value(s.argv, DECODE_TPOT_BUDGET_FLAG) == "8.5" for s in balanced.servers)
    plain = planned(tiny_model, 4, "--layout", "2p2d")
    assert not any(layouts.ROLE_SWITCH_SERVER_FLAG in s.argv for s in plain.servers)
    assert [s.bootstrap_port is None for s in plain.servers] == [False, False, True, True]


def test_named_layouts_fill_the_gpus_given(tiny_model):
    colocated = planned(tiny_model, 4, "--layout", "colocated")
    assert colocated.layout_line == "--layout colocated on 4 GPUs: 4 colocated servers"
    assert [(s.name, s.gpu) for s in colocated.servers] == [(f"worker {i}", i) for i in range(4)]
    assert all(flag_value(s.argv, "--disaggregation-mode") is None for s in colocated.servers)
    assert router_urls(colocated.router.argv, "--worker") == [s.url for s in colocated.servers]
    two_of_four = planned(tiny_model, 4, "--layout", "colocated", "--num-gpus", "2")
    assert [s.gpu for s in two_of_four.servers] == [0, 1]
    pd = planned(tiny_model, 4, "--layout", "2p2d", "--transfer-backend", "nccl")
    assert [(s.name, s.gpu) for s in pd.servers] == [("prefill 0", 0), ("prefill 1", 1), ("decode 0", 2),
                                                    ("decode 1", 3)]
    assert {flag_value(s.argv, "--disaggregation-transfer-backend") for s in pd.servers} == {"nccl"}
    assert flag_value(pd.router.argv, "--prefill-bootstrap-ports").isdigit()


def test_the_cpu_and_one_gpu_keep_the_default_pair_and_counts_given_override_the_layout(tiny_model):
    cpu = planned(tiny_model, 0)
    assert cpu.layout_line.startswith("--layout auto on the CPU for the mix workload: 1p1d (")
    assert cpu.placement.device == "cpu" and [s.name for s in cpu.servers] == ["prefill 0", "decode 0"]
    assert not any(f in cpu.router.argv for f in BALANCED_ROUTER_FLAGS)
    one_gpu = planned(tiny_model, 1)
    assert [s.gpu for s in one_gpu.servers] == [0, 0] and one_gpu.placement.one_by_one
    cpu_layout = planned(tiny_model, 0, "--layout", "colocated", "--num-gpus", "3")
    assert [s.name for s in cpu_layout.servers] == ["worker 0", "worker 1", "worker 2"]
    counts = planned(tiny_model, 4, "--prefill", "2", "--decode", "1")
    assert counts.layout_line is None and [s.name for s in counts.servers] == ["prefill 0", "prefill 1", "decode 0"]


def test_auto_with_servers_of_several_ranks_counts_servers_and_starts_the_plain_layout(tiny_model):
    ns, engine_args = parse_args(["--model-path", tiny_model, "--", "--tp-size", "2"])
    plan = plan_layout(ns, engine_args, 4)
    assert "for the mix workload: 1p1d (1 prefill + 1 decode); measured best" in plan.layout_line
    assert plan.layout_line.endswith("plain, as servers of 2 ranks take no TPOT budget or role switch")
    assert [(s.name, s.gpu, s.tp_size) for s in plan.servers] == [("prefill 0", 0, 2), ("decode 0", 2, 2)]
    assert not any(f in plan.router.argv for f in BALANCED_ROUTER_FLAGS)


@pytest.mark.parametrize("visible, flags, message", [
    (2, ["--layout", "3p1d"], "layout 3p1d needs 4 GPUs, 2 given"),
    (2, ["--num-gpus", "4"], "--num-gpus 4 but 2 GPU"),
    (4, ["--layout", "1p1d-balanced", "--decode-tp-size", "2"], "need servers of one rank"),
    (4, ["--layout", "2p2d", "--prefill-tp-size", "2"], "the servers need 6 GPUs .* but 4 are visible"),
])
def test_layouts_that_do_not_fit_the_gpus_are_refused(tiny_model, visible, flags, message):
    with pytest.raises(ClusterError, match=message):
        planned(tiny_model, visible, *flags)


@pytest.mark.parametrize("flags, message", [
    (["--layout", "1p1d", "--prefill", "2"], "--layout 1p1d names the servers itself"),
    (["--layout", "2x2"], "unknown layout '2x2'"),
    (["--layout", "0p1d"], "unknown layout '0p1d'"),
    (["--layout", "colocated-balanced"], "unknown layout"),
    (["--decode-tpot-budget-ms", "0"], "--decode-tpot-budget-ms must be positive"),
    (["--num-gpus", "0"], "--num-gpus must be at least 1"),
])
def test_bad_layout_flags_are_refused_before_anything_starts(flags, message):
    with pytest.raises(LaunchConfigError, match=message):
        parse_args(flags)


def test_layout_names_parse_into_server_counts():
    assert parse_layout("colocated", 3) == layouts.Layout("colocated", workers=3)
    assert parse_layout("1p3d-balanced", 4) == layouts.Layout("1p3d-balanced", prefill=1, decode=3, balanced=True)
    with pytest.raises(LayoutError, match="needs 5 GPUs"):
        layouts.check_fits(parse_layout("2p3d", 4), 4)
    layouts.check_fits(parse_layout("2p3d", 1), 1)  # one GPU: every server shares it
    assert parse_layout("2p2d-balanced-roles", 4) == layouts.Layout("2p2d-balanced-roles", prefill=2, decode=2,
                                                                    balanced=True, switch_roles=True)
    assert parse_layout("3p1d-roles", 4).switch_roles and not parse_layout("3p1d-roles", 4).balanced
    with pytest.raises(LayoutError, match="unknown layout"):
        parse_layout("1p1d-roles-balanced", 2)
    assert layouts.choose_layout("mix", 3)[0] == "1p2d-balanced-roles"  # a side with a server to spare
