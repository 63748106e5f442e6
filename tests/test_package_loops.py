"""No import loop between packages. A package here is a directory with modules (`gateway/openai`,
`gateway/models`, `worker/engine`, `worker/handoff`, ...; the modules directly in `gateway/` are
the package `gateway`), and package A imports package B when any module of A imports a module of
B. Module-level, function-level and TYPE_CHECKING imports all count: a lazy import still makes A
need B at run time, and a TYPE_CHECKING one still makes A's meaning depend on B's; a loop hidden
behind either is still a loop (tests/test_architecture.py counts them alike for module cycles).

A loop is reported with its packages and one import (file:line) of each edge of one cycle."""

from __future__ import annotations

from collections import deque
from pathlib import Path

from tests.test_architecture import ROOT, import_lines, module_files

imports_of = import_lines  # (project module, line) of each import, at any depth


Edges = dict[str, dict[str, str]]  # package -> imported package -> one import, "file:line"


def package_graph(files: dict[str, Path], root: Path = ROOT) -> Edges:
    """Package -> the packages it imports, each with its first import (by file, then line)."""
    known = set(files)
    package_of = {name: path.parent.relative_to(root).as_posix() for name, path in files.items()}
    graph: Edges = {package: {} for package in package_of.values()}
    for name, path in sorted(files.items(), key=lambda item: item[1]):
        here = package_of[name]
        for target, line in sorted(imports_of(name, path, known), key=lambda t: t[1]):
            there = package_of[target]
            if there != here:
                graph[here].setdefault(there, f"{path.relative_to(root).as_posix()}:{line}")
    return graph


def loops(graph: Edges) -> list[frozenset[str]]:
    """The strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(graph.get(node, {})):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while not component or node not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def one_cycle(graph: Edges, loop: frozenset[str]) -> list[str]:
    """One cycle through the loop's first package, shortest first (breadth-first), as
    'A -> B (file:line)' lines."""
    start = min(loop)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for succ in sorted(p for p in graph[node] if p in loop):
            if succ == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                path = [*reversed(path), start]
                return [f"{a} -> {b} ({graph[a][b]})" for a, b in zip(path, path[1:])]
            if succ not in parent:
                parent[succ] = node
                queue.append(succ)
    raise AssertionError(f"no cycle through {start} in {sorted(loop)}")


def report(graph: Edges, found: list[frozenset[str]]) -> list[str]:
    return [f"loop {sorted(loop)}: " + "; ".join(one_cycle(graph, loop)) for loop in found]


def test_the_loop_finder_names_a_loop_and_one_import_of_each_edge(tmp_path):
    """Negative control: a constructed tree whose packages `p/a` and `p/b` import each other
    (one of the imports lazy, inside a function), and `p/c` below them both."""
    files = {"p": "", "p.a": "", "p.a.x": "from p.b import y\n", "p.b": "",
             "p.b.y": "import p.c.z\n\ndef f():\n    from p.a.x import g\n", "p.c": "",
             "p.c.z": "X = 1\n"}
    paths = {}
    for name, text in files.items():
        parts = name.split(".")
        path = tmp_path.joinpath(*parts, "__init__.py") if text == "" else (
            tmp_path.joinpath(*parts[:-1], parts[-1] + ".py"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        paths[name] = path
    graph = package_graph(paths, tmp_path)
    assert graph == {"p": {}, "p/a": {"p/b": "p/a/x.py:1"},
                     "p/b": {"p/c": "p/b/y.py:1", "p/a": "p/b/y.py:4"}, "p/c": {}}
    found = loops(graph)
    assert found == [frozenset({"p/a", "p/b"})]
    assert report(graph, found) == [
        "loop ['p/a', 'p/b']: p/a -> p/b (p/a/x.py:1); p/b -> p/a (p/b/y.py:4)"]
    assert loops({"a": {"b": "x"}, "b": {}}) == []


def test_no_package_imports_a_package_that_imports_it_back():
    """The last loops (the engine's core beside its composition, the worker's loop beside the
    parts its handoffs use) were undone by issue 50's packages by concept: worker/engine/core,
    memory, kernels, model, parallel and tiers below the composition, worker/process above
    worker/ and worker/handoff."""
    graph = package_graph(module_files())
    assert len(graph) > 15 and "gateway/openai" in graph  # the walk saw the project
    assert "worker/engine/core" in graph and "worker/process" in graph
    assert report(graph, loops(graph)) == []
