"""What imports cannot show about the code's shape: no object is constructed with the whole
service that owns it (the worker's loop hands a part the few things it needs, typed: the in-flight
table, its own operations on a stream), and no object reads or writes another object's private
members (`other._name`: the owner's accessor instead). Checked over the product packages' text."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("shared", "worker", "batch", "gateway", "kvfleet")

# Reach-ins that predate this check, each with its reason; the list only shrinks (it is empty:
# the fan-out's poll timeout and a kernel linear's code are read through their properties).
KNOWN_REACH_INS: set[tuple[str, str]] = set()


def product_trees() -> dict[str, ast.Module]:
    return {path.relative_to(ROOT).as_posix(): ast.parse(path.read_text(), str(path))
            for package in PRODUCT for path in sorted((ROOT / package).rglob("*.py"))}


def private_members(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Private member name -> the classes that set it on `self` (or define it as a method)."""
    owners: dict[str, set[str]] = {}
    for tree in trees.values():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                name = None
                if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                        and isinstance(node.value, ast.Name) and node.value.id == "self"):
                    name = node.attr
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = node.name
                if name and name.startswith("_") and not name.startswith("__"):
                    owners.setdefault(name, set()).add(cls.name)
    return owners


def foreign_names(tree: ast.Module) -> set[str]:
    """Names the module imports from outside the project (another library's private API is
    torch_private.py's and the like's business, not this check's)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (
                (node.module or "").split(".")[0] not in PRODUCT):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names
                         if alias.name.split(".")[0] not in PRODUCT)
    return names


def reach_ins(trees: dict[str, ast.Module]) -> list[tuple[str, str]]:
    """(file, expression) of every `x._member` where `_member` is a private member of a class
    of the project and `x` is not `self`/`cls`, outside the classes that own that member (a
    class may read its own kind's members: a copy, a comparison)."""
    owners = private_members(trees)
    found = []
    for name, tree in trees.items():
        foreign = foreign_names(tree)
        for cls_or_module in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef))]:
            inside = getattr(cls_or_module, "name", None)
            body = cls_or_module.body
            for stmt in body:
                if cls_or_module is tree and isinstance(stmt, ast.ClassDef):
                    continue  # walked as its own class
                for node in ast.walk(stmt):
                    if (isinstance(node, ast.Attribute) and node.attr in owners
                            and not (isinstance(node.value, ast.Name)
                                     and node.value.id in ("self", "cls", *foreign))
                            and inside not in owners[node.attr]):
                        found.append((name, ast.unparse(node)))
    return sorted(set(found))


def constructed_with_self(trees: dict[str, ast.Module]) -> list[tuple[str, str]]:
    """(file, call) of every object built with `self` as an argument inside a class named
    ...Service: a part handed the whole service."""
    found = []
    for name, tree in trees.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            if not cls.name.endswith("Service"):
                continue
            for node in ast.walk(cls):
                if not isinstance(node, ast.Call):
                    continue
                callee = ast.unparse(node.func).rsplit(".", 1)[-1]
                args = [*node.args, *(k.value for k in node.keywords)]
                if callee[:1].isupper() and any(isinstance(a, ast.Name) and a.id == "self"
                                                for a in args):
                    found.append((name, ast.unparse(node)))
    return found


def test_the_checks_find_a_reach_in_and_a_service_handed_over():
    trees = {"x.py": ast.parse(
        "class Part:\n"
        "    def __init__(self, service):\n"
        "        self._count = 0\n"
        "        self.service = service\n"
        "    def copy(self, other):\n"
        "        return other._count\n"
        "class WorkerService:\n"
        "    def __init__(self):\n"
        "        self.part = Part(self)\n"
        "    def peek(self):\n"
        "        return self.part._count\n")}
    assert reach_ins(trees) == [("x.py", "self.part._count")]
    assert constructed_with_self(trees) == [("x.py", "Part(self)")]


def test_no_object_is_constructed_with_the_whole_service():
    assert constructed_with_self(product_trees()) == []


def test_no_object_reaches_into_anothers_private_members():
    assert [r for r in reach_ins(product_trees()) if r not in KNOWN_REACH_INS] == []
