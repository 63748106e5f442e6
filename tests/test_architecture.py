"""The shape of the code base: no import cycles, each package imports only the layers below it,
every module imports in a fresh interpreter, benchmarks run as modules without `sys.path` edits,
no tracked file refers outside the repository (no path of the machine the checkout lives on, of
any particular machine, or beside the checkout), and docs/ARCHITECTURE.md names every Redis key,
Lua script and fleet term a reader meets in the code."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("shared", "worker", "batch", "gateway", "kvfleet")
SUBPACKAGES = ("shared", "worker", "batch", "gateway")  # folders imported as kvfleet.<folder>
PACKAGES = (*PRODUCT, "benchmarks")

# What each product package may import (itself included). `shared` is the wire contract and the
# settings; nothing in `worker/` imports `gateway/` or the reverse (the two talk through Redis only); the batch
# back end runs in its own process and knows only the contract; `kvfleet` is the CLI glue.
ALLOWED = {
    "shared": {"shared"},
    "worker": {"shared", "worker"},
    "batch": {"shared", "batch"},
    "gateway": {"shared", "batch", "gateway"},
    "kvfleet": {"shared", "worker", "batch", "gateway", "kvfleet"},
}


def module_files() -> dict[str, Path]:
    """Every module of the project's packages, by the name it is imported as (packages by their
    __init__): the folders gateway/, worker/, shared/ and batch/ are kvfleet.gateway and so on."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts[0] in SUBPACKAGES:
                parts = ("kvfleet", *parts)
            modules[".".join(parts)] = path
    return modules


def layer(name: str) -> str:
    """The product package (ALLOWED's key) of the module imported as `name`."""
    parts = name.split(".")
    return parts[1] if parts[0] == "kvfleet" and len(parts) > 1 and parts[1] in SUBPACKAGES \
        else parts[0]


def import_lines(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(project module, line) of every import of module `name` anywhere in its text: at module
    level, inside functions and under TYPE_CHECKING alike (tests/test_package_loops.py too)."""
    is_package = path.name == "__init__.py"
    found = []
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
        found += [(t, node.lineno) for t in targets if t in known and t != name]
    return found


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its text (a cycle through a lazy import is
    still a cycle)."""
    return {target for target, _ in import_lines(name, path, known)}


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
        package = layer(name)
        if package not in ALLOWED:
            continue
        wrong += [f"{name} -> {target}" for target in sorted(targets)
                  if layer(target) not in ALLOWED[package]]
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
    """This checkout and the main checkout it may be a worktree of: paths that differ from
    machine to machine."""
    common = subprocess.run(["git", "rev-parse", "--path-format=absolute", "--git-common-dir"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    return {ROOT, Path(common).parent}


# Paths and tools of particular development or CI machines, wherever this checkout lives: the
# agents' workspace, a CI scratch folder, a root or macOS home, the team's CPU lock. Container
# files are exempt from the home folders: there they name paths inside the image.
# (each needle written in two pieces, so this file does not hold the paths it looks for)
MACHINE_NEEDLES = ("/wor" "k/", "/tmp/c" "i", "/roo" "t/", "/User" "s/", "cpu" "lock")
IMAGE_PATH_NEEDLES = ("/roo" "t/",)
CONTAINER_FILES = ("Dockerfile", "docker-compose.yml")


def tracked_texts() -> dict[str, str]:
    """The text of every tracked file (binary model and image files left out)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert tracked, "not a git checkout: cannot list the tracked files"
    return {name: (ROOT / name).read_text(errors="replace") for name in tracked
            if (ROOT / name).is_file() and Path(name).suffix not in (".gguf", ".png", ".safetensors")}


def test_no_path_of_this_checkout_is_written_into_the_tree():
    needles = {f"{path}/" for path in checkout_paths()}
    hits = [f"{name}: {needle}" for name, text in tracked_texts().items()
            for needle in sorted(needles) if needle in text]
    assert hits == []


def machine_paths_in(name: str, text: str) -> list[str]:
    exempt = IMAGE_PATH_NEEDLES if Path(name).name in CONTAINER_FILES else ()
    return [f"{name}: {needle}" for needle in MACHINE_NEEDLES
            if needle in text and needle not in exempt]


def test_the_machine_path_check_finds_one():
    assert machine_paths_in("docs/X.md", "run it under /wor" "k/tools/cpu" "lock exclusive") == [
        "docs/X.md: /wor" "k/", "docs/X.md: cpu" "lock"]
    assert machine_paths_in("Dockerfile", "--mount=type=cache,target=/roo" "t/.cache/pip") == []
    assert machine_paths_in("deploy/run.sh", "cd /roo" "t/kvfleet") == ["deploy/run.sh: /roo" "t/"]


def test_no_machine_specific_path_or_tool_is_written_into_the_tree():
    """Docs included: a benchmark's command reads the same on every machine."""
    this_file = str(Path(__file__).resolve().relative_to(ROOT))  # holds the needles themselves
    hits = [hit for name, text in tracked_texts().items() if name != this_file
            for hit in machine_paths_in(name, text)]
    assert hits == []


# Paths beside the checkout: a clone has nothing there (the needle in two pieces, as above).
OUTSIDE_NEEDLES = (".." "/shared", ".." "/workloads")
# Python that climbs above the repository root from its own file: `Path(__file__).parents[k]`
# or `.parent` chains past the root, or the root's own parent.
PARENTS_INDEX = re.compile(r"__file__\)(?:\.resolve\(\))?\.parents\[(\d+)\]")
PARENT_CHAIN = re.compile(r"__file__\)(?:\.resolve\(\))?((?:\.parent\b)+)")
ROOT_PARENT = re.compile(r"\b(?:ROOT|REPO)\.parent\b")


def outside_references_in(name: str, text: str) -> list[str]:
    """What in tracked file `name` points outside the repository."""
    hits = [f"{name}: {needle}" for needle in OUTSIDE_NEEDLES if needle in text]
    if name.endswith(".py"):
        depth = len(Path(name).parts)  # parents[depth - 1] is the repository root
        hits += [f"{name}: parents[{k}]" for k in map(int, PARENTS_INDEX.findall(text))
                 if k >= depth]
        hits += [f"{name}: {chain}" for chain in PARENT_CHAIN.findall(text)
                 if chain.count(".parent") > depth]
        hits += [f"{name}: {m}" for m in ROOT_PARENT.findall(text)]
    return hits


def test_the_outside_reference_check_finds_one():
    assert outside_references_in("docs/X.md", "kvfleet bench .." "/shared/workloads/a.jsonl") == [
        "docs/X.md: .." "/shared"]
    climb = 'W = Path(__file__).resolve().parents[2] / "shared"\n'
    assert outside_references_in("benchmarks/x.py", climb) == ["benchmarks/x.py: parents[2]"]
    assert outside_references_in("tests/engine/x.py", climb) == []  # the root, from two down
    assert outside_references_in("benchmarks/x.py", "Path(__file__).parent.parent.parent") == [
        "benchmarks/x.py: .parent.parent.parent"]
    assert outside_references_in("benchmarks/x.py", 'W = REPO.parent / "shared"') == [
        "benchmarks/x.py: REPO.parent"]
    assert outside_references_in("benchmarks/x.py", 'W = REPO / "benchmarks" / "data"') == []


def test_no_tracked_file_refers_outside_the_repository():
    """A clone is complete: no default, command or link reaches beside the checkout."""
    this_file = str(Path(__file__).resolve().relative_to(ROOT))
    hits = [hit for name, text in tracked_texts().items() if name != this_file
            for hit in outside_references_in(name, text)]
    assert hits == []


ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
# The fleet's words that docs/ARCHITECTURE.md's glossary defines (an entry `- **term** — ...`).
GLOSSARY_TERMS = (
    "attempt", "block", "checkpoint", "claim / takeover", "dead-letter", "fencing",
    "gateway shares", "heartbeat", "home shard", "inbox", "preemption: swap / recompute",
    "prefix cache", "reply channel", "roster", "steal / steal-after", "stream shard", "watched",
    "announce id", "own stream", "prefix index", "routing: affinity / shared",
)


def keys_names() -> list[str]:
    """Every key-building method and attribute of `Keys`."""
    from kvfleet.shared.wire.keys import Keys
    return sorted(name for name in dir(Keys) if not name.startswith("_"))


def script_names() -> list[str]:
    """The module-level names of the Lua scripts of the wire contract."""
    from kvfleet.shared.wire import affinity, batch_scripts, scripts
    from kvfleet.shared.wire.lua import LuaScript
    return sorted(name for module in (scripts, batch_scripts, affinity)
                  for name, value in vars(module).items()
                  if isinstance(value, LuaScript))


def undocumented(names: list[str], text: str) -> list[str]:
    """The names that `text` never writes as code (`name` or `name(...)`)."""
    return [name for name in names if f"`{name}`" not in text and f"`{name}(" not in text]


def glossary(text: str) -> str:
    """The Glossary section of the architecture document."""
    section = text.split("\n## Glossary\n", 1)
    assert len(section) == 2, "docs/ARCHITECTURE.md has no '## Glossary' section"
    return section[1].split("\n## ", 1)[0]


def undefined_terms(terms: tuple[str, ...], text: str) -> list[str]:
    entries = glossary(text)
    return [term for term in terms if f"\n- **{term}**" not in "\n" + entries]


def test_the_architecture_checks_find_a_missing_name():
    assert undocumented(["queue", "cancel", "ENQUEUE"], "`queue(model)` and `ENQUEUE`") == ["cancel"]
    text = "# A\n\n## Glossary\n\n- **inbox** — a channel\n\n## Invariants\n\n- **roster** x\n"
    assert undefined_terms(("inbox", "roster"), text) == ["roster"]


def test_the_architecture_names_every_key_and_script():
    assert len(keys_names()) > 20 and "ENQUEUE" in script_names()
    text = ARCHITECTURE.read_text()
    assert undocumented(keys_names() + script_names(), text) == []


def test_the_architecture_defines_the_fleet_terms():
    assert undefined_terms(GLOSSARY_TERMS, ARCHITECTURE.read_text()) == []


def unnamed_parts(folder: str, text: str) -> list[str]:
    """The modules and packages directly under `folder` that `text` never names as code."""
    parts = [p for p in sorted((ROOT / folder).iterdir())
             if (p.suffix == ".py" and p.name != "__init__.py")
             or (p.is_dir() and (p / "__init__.py").exists())]
    return [p.relative_to(ROOT).as_posix() for p in parts
            if f"`{p.relative_to(ROOT).as_posix()}" not in text and f"`{p.name}" not in text]


def test_the_architecture_names_every_part_of_the_worker():
    """docs/ARCHITECTURE.md's components table names every module and package of `worker/`
    and of its handoffs (`worker/affinity.py` and `worker/structured/` went unmentioned)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert unnamed_parts("worker", text) == []
    assert unnamed_parts("worker/handoff", text) == []


def unnamed_packages(root: Path, text: str) -> list[str]:
    """The packages (folders with an __init__.py) of the product that `text` never names as
    code: `gateway/http` as `gateway/http/...` or, within its parent's row, `http/`."""
    packages = sorted(init.parent.relative_to(root).as_posix() for top in PRODUCT
                      for init in (root / top).rglob("__init__.py"))
    return [p for p in packages
            if f"`{p}" not in text and f"`{p.rsplit('/', 1)[-1]}/" not in text]


def test_the_package_check_finds_an_unnamed_package(tmp_path):
    for folder in ("gateway/http", "gateway/tools", "worker"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text("")
    text = "| gateway | `gateway/` | errors (`http/`) |\n| worker | `worker/process/service.py` |"
    assert unnamed_packages(tmp_path, text) == ["gateway/tools"]


def test_the_architecture_names_every_package():
    """Every package of shared/, worker/, gateway/, batch/ and kvfleet/, nested ones included."""
    assert unnamed_packages(ROOT, ARCHITECTURE.read_text()) == []


def table_rows(text: str, heading: str) -> list[str]:
    """The first cells of the table under `heading` (the header row and its rule left out)."""
    section = ("\n" + text).split(f"\n{heading}\n", 1)
    assert len(section) == 2, f"docs/ARCHITECTURE.md has no {heading!r} section"
    rows = [line for line in section[1].split("\n#", 1)[0].splitlines() if line.startswith("|")]
    return [row.split("|")[1].strip() for row in rows[2:]]


def repeated(cells: list[str]) -> list[str]:
    return sorted({cell for cell in cells if cells.count(cell) > 1})


def test_the_records_check_finds_a_repeated_row():
    text = ("### Records and messages\n\n| record | where |\n|---|---|\n| `QueueEntry` | a |\n"
            "| `KvEvent` | b |\n| `QueueEntry` | c |\n\n### Scripts\n\n| `QueueEntry` | d |\n")
    assert table_rows(text, "### Records and messages") == ["`QueueEntry`", "`KvEvent`",
                                                            "`QueueEntry`"]
    assert repeated(table_rows(text, "### Records and messages")) == ["`QueueEntry`"]


def test_each_record_has_one_row():
    rows = table_rows(ARCHITECTURE.read_text(), "### Records and messages")
    assert "`QueueEntry`" in rows and "`Heartbeat`" in rows
    assert repeated(rows) == []


# A style guide the repository does not have: code and docs state a rule in words instead of
# citing its number there (the needle in two pieces, so this file does not hold it).
ABSENT_GUIDE = "STYLE" ".md"


def test_nothing_cites_a_style_guide_the_repository_does_not_have():
    assert not (ROOT / ABSENT_GUIDE).exists()
    this_file = str(Path(__file__).resolve().relative_to(ROOT))
    assert [name for name, text in tracked_texts().items()
            if name != this_file and ABSENT_GUIDE in text] == []
