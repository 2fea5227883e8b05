"""The package layout holds: no import circles, the router imports nothing of `pdserve`, the HTTP server only the
entry points of the scheduler and detokenizer processes, `scheduler/` never imports `disagg/` (the scheduler
child's entry, `pdserve/scheduler_main.py`, assembles both), the PD handoff protocol and the modules of the HTTP
server and the detokenizer load without torch, a PD role touches the scheduler only through `SchedulerAPI` (no
member outside it), nothing subclasses the scheduler, only `pdserve/scheduler` touches the scheduler's private
methods, and the offline engine never loads the HTTP server (nor the launchers)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (ROOT / "pdserve", ROOT / "router" / "pdserve_router")


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """Every module name an import statement anywhere in the file may load (lazy and TYPE_CHECKING ones too)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of PACKAGES it imports. `from pkg import mod` depends on mod, not on pkg."""
    files = {module_name(f, package): f for package in PACKAGES for f in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        names = imported_names(ast.parse(path.read_text()), module, path.name == "__init__.py")
        targets = {n for n in names if n in files and n != module}
        graph[module] = {t for t in targets if not any(o.startswith(t + ".") for o in targets)}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


SCHEDULER_ENTRY = "pdserve.scheduler_main"  # the scheduler child's entry: assembles the scheduler and its PD role


def test_scheduler_never_imports_disagg():
    graph = import_graph()
    upward = sorted((src, dst) for src, targets in graph.items() for dst in targets
                    if src.split(".")[:2] == ["pdserve", "scheduler"] and dst.startswith("pdserve.disagg"))
    assert upward == []
    assert "pdserve.disagg.handoff" in graph["pdserve.disagg.decode"]  # the walk sees the imports it checks
    assert "pdserve.disagg.factory" in graph[SCHEDULER_ENTRY]


@pytest.mark.parametrize("modules", [
    "pdserve.disagg.handoff",  # the PD handoff protocol
    "pdserve.launch_server, pdserve.server.serve",  # the HTTP process's (AutoTokenizer imports torch when it runs)
    "pdserve.detokenizer.process, pdserve.ipc, pdserve.messages, pdserve.process_setup, pdserve.tokenizer",
])
def test_modules_import_without_torch(modules):
    probe = f"import sys, {modules}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` loads, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for succ in graph[todo.pop()] - seen:
            seen.add(succ)
            todo.append(succ)
    return seen


def test_offline_engine_never_imports_the_http_server():
    graph = import_graph()
    http_server = sorted(m for m in reachable(graph, "pdserve.llm") if m.split(".")[:2] == ["pdserve", "server"])
    assert http_server == []
    assert "pdserve.server_processes" not in reachable(graph, "pdserve.llm")  # nor the launchers
    assert "pdserve.scheduler.scheduler" in reachable(graph, "pdserve.llm")  # the walk follows the imports


def parsed(package: Path) -> dict[str, ast.Module]:
    return {module_name(f, package): ast.parse(f.read_text()) for f in package.rglob("*.py")}


SCHEDULER_MODULE = "pdserve.scheduler.scheduler"
SCHEDULER_BUILDER = "pdserve.disagg.factory"  # builds the Scheduler with its role; holds no role of its own


def scheduler_api() -> set[str]:
    """The members of `SchedulerAPI` (`scheduler/role.py`): what a role may use of its scheduler."""
    tree = ast.parse((ROOT / "pdserve" / "scheduler" / "role.py").read_text())
    api = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SchedulerAPI")
    return ({n.target.id for n in api.body if isinstance(n, ast.AnnAssign)}
            | {n.name for n in api.body if isinstance(n, ast.FunctionDef)})


def names_the_scheduler(node: ast.AST) -> bool:
    return ast.unparse(node).split(".")[-1] in ("scheduler", "sched")


def uses_beyond_the_api(tree: ast.Module, api: set[str]) -> list[str]:
    """A role's uses of its scheduler that `SchedulerAPI` does not cover: a member outside it, and the scheduler
    bound to another name or handed to a call (where this check could not follow it)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and names_the_scheduler(node.value) and node.attr not in api:
            found.append(ast.unparse(node))
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None \
                and names_the_scheduler(node.value):
            found.append(ast.unparse(node))
        elif isinstance(node, ast.Call) and any(names_the_scheduler(a) for a in [*node.args, *node.keywords]):
            found.append(ast.unparse(node))
    return found


def test_a_pd_role_touches_the_scheduler_only_through_scheduler_api():
    api, graph = scheduler_api(), import_graph()
    roles = {m: tree for m, tree in parsed(ROOT / "pdserve").items() if m.startswith("pdserve.disagg")}
    beyond = {module: uses for module, tree in roles.items() if (uses := uses_beyond_the_api(tree, api))}
    assert beyond == {}
    importers = sorted(m for m in roles if SCHEDULER_MODULE in graph[m])
    assert importers == [SCHEDULER_BUILDER]  # the concrete Scheduler is out of a role's reach
    builder_classes = [n for n in ast.walk(roles[SCHEDULER_BUILDER]) if isinstance(n, ast.ClassDef)]
    assert builder_classes == []
    assert {"enqueue", "admit", "finish"} <= api  # the walk reads the protocol it checks against


def test_uses_beyond_the_api_are_found():
    code = ("self.scheduler.enqueue(r)\nself.scheduler.radix.match_prefix(ids)\nself.scheduler.waiting.append(r)\n"
            "self.scheduler._finish(r)\ns = self.scheduler\nhelper(self.scheduler)\ngetattr(sched, 'x')")
    found = uses_beyond_the_api(ast.parse(code), {"enqueue", "radix"})
    assert sorted(found) == ["getattr(sched, 'x')", "helper(self.scheduler)", "s = self.scheduler",
                             "self.scheduler._finish", "self.scheduler.waiting"]


def test_the_http_server_imports_only_the_entry_points_of_the_processes_it_starts():
    graph = import_graph()
    reached = {dst for src, targets in graph.items() if src.startswith("pdserve.server") for dst in targets
               if dst.startswith(("pdserve.scheduler", "pdserve.detokenizer", "pdserve.disagg"))}
    assert reached == {SCHEDULER_ENTRY, "pdserve.detokenizer.process"}


def test_the_router_imports_nothing_of_pdserve():
    graph = import_graph()
    assert sorted((src, dst) for src, targets in graph.items() if src.startswith("pdserve_router")
                  for dst in targets if dst.split(".")[0] == "pdserve") == []


def private_scheduler_calls(tree: ast.Module) -> list[str]:
    """`scheduler._x` / `sched._x` / `self.scheduler._x` in the file, as written."""
    return [ast.unparse(node) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            and ast.unparse(node.value).split(".")[-1] in ("scheduler", "sched")]


def test_no_module_outside_the_scheduler_calls_a_private_scheduler_method():
    outside = {m: t for package in PACKAGES for m, t in parsed(package).items()
               if not m.startswith("pdserve.scheduler")}
    assert {m: calls for m, tree in outside.items() if (calls := private_scheduler_calls(tree))} == {}


def test_private_scheduler_calls_are_found():
    found = private_scheduler_calls(ast.parse("self.scheduler._finish(r)\nsched._x\nself.scheduler.finish(r)"))
    assert sorted(found) == ["sched._x", "self.scheduler._finish"]


def scheduler_subclasses(tree: ast.Module) -> list[str]:
    """Classes in the file with `Scheduler` (`pdserve.scheduler.scheduler`'s) among their bases, under any name an
    import gave it: `Scheduler`, an alias, `module.Scheduler`."""
    aliases = {"Scheduler"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("scheduler"):
            aliases.update(a.asname or a.name for a in node.names if a.name == "Scheduler")
    return [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
            if any(ast.unparse(base).split(".")[-1] in aliases for base in node.bases)]


def test_nothing_subclasses_the_scheduler():
    """A PD role (or any other part) is an object the scheduler holds, never a Scheduler subclass."""
    found = {m: classes for package in PACKAGES for m, tree in parsed(package).items()
             if (classes := scheduler_subclasses(tree))}
    assert found == {}


def test_scheduler_subclasses_are_found():
    code = ("from pdserve.scheduler.scheduler import Scheduler as Base\nimport pdserve.scheduler.scheduler as s\n"
            "class A(Base): pass\nclass B(s.Scheduler): pass\nclass C(Scheduler): pass\nclass D(Role): pass")
    assert scheduler_subclasses(ast.parse(code)) == ["A", "B", "C"]
