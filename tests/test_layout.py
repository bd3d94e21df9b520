"""The package's shape: no import circles (module-level or deferred into a function), and the generic
communication pass knows no schedule by name (a schedule's own pass registers itself)."""
import ast
import os

from megatron_pp.schedules import comm
from megatron_pp.schedules.ir import PARTNER_OP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_graph(root: str = os.path.join(ROOT, "megatron_pp")) -> dict[str, set[str]]:
    """module -> the megatron_pp modules it imports anywhere in its file (deferred imports included)."""
    graph: dict[str, set[str]] = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            module = os.path.relpath(path[:-3], os.path.dirname(root)).replace(os.sep, ".")
            module = module.removesuffix(".__init__")
            deps: set[str] = set()
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_pp"):
                    deps.add(node.module)
                    deps.update(f"{node.module}.{a.name}" for a in node.names)
                elif isinstance(node, ast.Import):
                    deps.update(a.name for a in node.names if a.name.startswith("megatron_pp"))
            graph[module] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_cycle_finder_sees_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_in_the_package():
    assert cycles(import_graph()) == []


def test_communication_insertion_names_no_schedule_module():
    imported = import_graph()["megatron_pp.schedules.comm"]
    assert imported <= {"megatron_pp.schedules.ir"}, imported
    # Code, not prose: no identifier or string literal of the module names a schedule's own pass.
    tree = ast.parse(open(comm.__file__).read())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
            {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not {n for n in names if "bpipe" in n.lower() or n == "add_hosting"}, names


def test_bpipe_registers_its_hosting_as_a_pass_after_communication():
    from megatron_pp.schedules import bpipe

    assert (frozenset(PARTNER_OP), bpipe.add_hosting) in comm._PASSES_AFTER_COMMUNICATION


def test_no_package_module_over_600_lines():
    long = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "megatron_pp")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                count = sum(1 for _ in open(path))
                if count > 600:
                    long[os.path.relpath(path, ROOT)] = count
    assert long == {}


def test_no_package_function_over_80_lines():
    """Issue 35's rule for the package: a function that needs more than 80 lines is split (decorators and the
    signature count; nested functions count within their parent as well as on their own)."""
    long = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "megatron_pp")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                        if node.end_lineno - first + 1 > 80:
                            long[f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name}"] = node.end_lineno - first + 1
    assert long == {}
