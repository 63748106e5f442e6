"""The shape of the code base: no import cycles, each package imports only the layers below it,
every module imports in a fresh interpreter, benchmarks run as modules without `sys.path` edits,
and no path of the machine the checkout lives on is written into the tree."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("shared", "worker", "batch", "gateway", "kvfleet")
PACKAGES = (*PRODUCT, "benchmarks")

# What each product package may import (itself included). `shared` is the wire contract and the
# settings; nothing in `worker/` imports `gateway/` or the reverse (STYLE.md rule 1); the batch
# back end runs in its own process and knows only the contract; `kvfleet` is the CLI glue.
ALLOWED = {
    "shared": {"shared"},
    "worker": {"shared", "worker"},
    "batch": {"shared", "batch"},
    "gateway": {"shared", "batch", "gateway"},
    "kvfleet": {"shared", "worker", "batch", "gateway", "kvfleet"},
}


def module_files() -> dict[str, Path]:
    """Every module of the project's packages, by dotted name (packages by their __init__)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its text: at module level, inside
    functions and under TYPE_CHECKING alike (a cycle through a lazy import is still a cycle)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join([*package, base] if base else package)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: imported_modules(name, path, known) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_and_type_checking_imports(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.q import X\n"
                      "def f():\n    import p.r\n    from p import s\n")
    known = {"p", "p.q", "p.r", "p.s", "mod"}
    assert imported_modules("mod", source, known) == {"p.q", "p.r", "p.s"}


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_each_package_imports_only_what_it_may():
    wrong = []
    for name, targets in import_graph().items():
        package = name.split(".")[0]
        if package not in ALLOWED:
            continue
        wrong += [f"{name} -> {target}" for target in sorted(targets)
                  if target.split(".")[0] not in ALLOWED[package]]
    assert wrong == []


def test_every_module_imports_in_a_fresh_interpreter():
    """Run from the repository root with nothing added to sys.path: benchmarks included."""
    names = sorted(name for name in module_files() if not name.endswith("__main__"))
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    done = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("package", PACKAGES)
def test_nothing_edits_sys_path(package):
    edits = [str(path.relative_to(ROOT)) for path in (ROOT / package).rglob("*.py")
             if "sys.path.insert" in path.read_text() or "sys.path.append" in path.read_text()]
    assert edits == []


def checkout_paths() -> set[Path]:
    """This checkout, the main checkout it may be a worktree of, and the team folder beside them
    (`../shared`, where it exists): paths that differ from machine to machine."""
    common = subprocess.run(["git", "rev-parse", "--path-format=absolute", "--git-common-dir"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    roots = {ROOT, Path(common).parent}
    return roots | {root.parent / "shared" for root in roots if (root.parent / "shared").is_dir()}


def test_no_path_of_this_checkout_is_written_into_the_tree():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert tracked, "not a git checkout: cannot list the tracked files"
    needles = {f"{path}/" for path in checkout_paths()}
    hits = []
    for name in tracked:
        path = ROOT / name
        if path.is_file() and path.suffix not in (".gguf", ".png", ".safetensors"):
            text = path.read_text(errors="replace")
            hits += [f"{name}: {needle}" for needle in sorted(needles) if needle in text]
    assert hits == []
