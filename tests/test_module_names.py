"""One meaning per module name. A module's file name (`protocol.py`, `metrics.py`) is what a
reader meets first in a traceback, a diff or a search; used in two packages it must mean one
thing there too. The rule: a file name in more than one product package is allowed only where
it names one concept at different layers (the wire contract, the worker's side, the gateway's
side of prefix-affinity routing: `affinity.py`) or one role in sibling packages (each command
package's `command.py`), and SHARED_NAMES below says which and what each module is. A new
duplicate, or a new module under a listed name, fails until it is listed or renamed; an entry
whose module is gone fails too. (`__init__.py` and `__main__.py` are Python's names, not ours.)"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("shared", "worker", "batch", "gateway", "kvfleet")
PYTHON_NAMES = {"__init__.py", "__main__.py"}

# file name -> (what it names in every package, {module: what this one is})
SHARED_NAMES: dict[str, tuple[str, dict[str, str]]] = {
    "affinity.py": ("prefix-affinity routing, one layer each", {
        "shared/wire/affinity.py": "its wire contract: the announcement stream, the index scripts",
        "worker/affinity.py": "a worker's Redis side of it: own streams' owners, resumes' owner",
        "gateway/fleet/affinity.py": "the gateway's routing: which own stream a request goes to",
    }),
    "client.py": ("role: the client a package talks to its server through", {
        "gateway/fleet/client.py": "the engine client interface the gateway's handlers call",
        "kvfleet/bench/client.py": "the benchmark's HTTP client: one streaming request, timed",
    }),
    "command.py": ("role: the `kvfleet` subcommand a package implements (flags, run)", {
        "kvfleet/bench/command.py": "`kvfleet bench`",
        "kvfleet/plan/command.py": "`kvfleet plan`",
    }),
    "engine.py": ("the engine: one step loop over the engine's parts", {
        "worker/engine/engine.py": "the engine itself (schedule, execute, sample, update)",
        "worker/sim/engine.py": "the same engine over a cost model instead of a forward pass",
    }),
    "feature.py": ("role: an engine feature's plug into the step lifecycle (lifecycle.py)", {
        "worker/engine/lora/feature.py": "LoRA's hooks",
        "worker/engine/speculation/feature.py": "speculative decoding's hooks (and draft model)",
    }),
    "handoff.py": ("KV handoff of a running stream between workers, one layer each", {
        "shared/wire/handoff.py": "its wire contract: offers, takes, leases, the fence",
        "worker/engine/core/handoff.py": "the engine's side: the state that moves, and its encoding",
    }),
    "metrics.py": ("a process's Prometheus metrics, one process each", {
        "gateway/dashboard/metrics.py": "the gateway's (latency as clients see it, outcomes)",
        "worker/metrics.py": "a worker's (what its engine did each step)",
    }),
    "numerics.py": ("the numerics fingerprint (how an engine rounds), one layer each", {
        "worker/engine/model/numerics.py": "the engine's: computing its own fingerprint",
        "worker/numerics.py": "the fleet's: live workers' fingerprints, who goes first on resume",
    }),
    "pace.py": ("the promised pace (--target-itl-ms, --target-ttft-ms), one layer each", {
        "shared/pace.py": "the targets and the step-cost curve, as heartbeats carry them",
        "worker/engine/core/pace.py": "the engine's: the cost fitted online, the group that keeps it",
        "gateway/fleet/pace.py": "the gateway's: the fleet's capacity at pace, from heartbeats",
        "kvfleet/plan/pace.py": "the planner's: streams and tokens/s from a measured curve",
    }),
    "prompt_logprobs.py": ("the prompt tokens' logprobs, one layer each", {
        "worker/engine/core/prompt_logprobs.py": "the engine's: computed from the prefill's logits",
        "gateway/openai/prompt_logprobs.py": "the API's: the two shapes clients read them in",
    }),
    "protocol.py": ("role: a worker part's Redis side of the fleet protocol", {
        "worker/protocol.py": "the loop's and the heartbeat's reads and writes",
        "worker/handoff/protocol.py": "the handoffs': offers, takes, leases, the fence",
    }),
    "report.py": ("role: a command's output for an operator (text table, JSON)", {
        "kvfleet/bench/report.py": "a benchmark run's and a sweep's",
        "kvfleet/plan/report.py": "a capacity plan's",
    }),
    "tracing.py": ("OpenTelemetry traces (--otlp-traces-endpoint), one layer each", {
        "shared/tracing.py": "the setup: provider, exporter, the context's wire form",
        "gateway/http/tracing.py": "the gateway's: a request's HTTP span and its GenAI attributes",
        "worker/tracing.py": "a worker's: a request's spans there, from its timeline's instants",
    }),
}


def module_paths(root: Path = ROOT) -> list[str]:
    return [path.relative_to(root).as_posix() for package in PRODUCT
            for path in sorted((root / package).rglob("*.py")) if path.name not in PYTHON_NAMES]


def unlisted_duplicates(paths: list[str], table: dict) -> list[str]:
    """The file names used by more than one module whose modules the table does not list
    exactly: a new duplicate, a new module under a listed name, or an entry whose module is
    gone (each as 'name: modules found / modules listed')."""
    found: dict[str, set[str]] = {}
    for path in paths:
        found.setdefault(Path(path).name, set()).add(path)
    problems = []
    for name in sorted(set(found) | set(table)):
        modules = found.get(name, set())
        listed = set(table[name][1]) if name in table else set()
        if (len(modules) > 1 or listed) and modules != listed:
            problems.append(f"{name}: found {sorted(modules)} / listed {sorted(listed)}")
    return problems


def test_the_check_finds_a_new_duplicate_a_new_member_and_a_stale_entry():
    table = {"pace.py": ("the pace", {"a/pace.py": "one", "b/pace.py": "two"})}
    assert unlisted_duplicates(["a/pace.py", "b/pace.py", "a/x.py"], table) == []
    assert unlisted_duplicates(["a/pace.py", "b/pace.py", "a/x.py", "b/x.py"], table) == [
        "x.py: found ['a/x.py', 'b/x.py'] / listed []"]
    assert unlisted_duplicates(["a/pace.py", "b/pace.py", "c/pace.py"], table) == [
        "pace.py: found ['a/pace.py', 'b/pace.py', 'c/pace.py'] / listed "
        "['a/pace.py', 'b/pace.py']"]
    assert unlisted_duplicates(["a/pace.py"], table) == [
        "pace.py: found ['a/pace.py'] / listed ['a/pace.py', 'b/pace.py']"]


def test_the_walk_sees_the_project(tmp_path):
    (tmp_path / "worker" / "engine").mkdir(parents=True)
    for name in ("worker/__init__.py", "worker/pace.py", "worker/engine/pace.py"):
        (tmp_path / name).write_text("")
    assert module_paths(tmp_path) == ["worker/engine/pace.py", "worker/pace.py"]


def test_each_module_name_has_one_meaning():
    paths = module_paths()
    assert "worker/engine/engine.py" in paths and "gateway/openai/routes.py" in paths
    assert unlisted_duplicates(paths, SHARED_NAMES) == []


def test_the_table_says_what_each_module_is():
    """No entry without its concept or without a meaning for each module; no entry of one."""
    assert all(concept and len(modules) > 1 and all(modules.values())
               for concept, modules in SHARED_NAMES.values())
