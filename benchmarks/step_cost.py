"""A step's fixed cost, before and after a change: two git revisions of the engine timed in
alternated rounds (A, B, A, B, ...), each round a fresh process on the default model (or
`--model`'s).

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 .venv/bin/python -m benchmarks.step_cost \\
        --revisions main HEAD --rounds 3

Each round times three kinds of step in one in-process engine (greedy, ignore_eos, random
prompts so that nothing is found in the prefix cache): a decode step of 1 stream, a decode step
of 32 streams (128-token prompts, prefilled first), and a step that prefills one 512-token
prompt. A straight line through the three (seconds = a + b x tokens, least squares) gives `a`,
the cost of a step that does not scale with its tokens. The table gives each revision's medians
over its rounds of the step times (wall and the process's CPU time: on a shared host the CPU
time moves less with the other processes' load) and of `a`, and the load averages around the
rounds. A revision is exported with `git archive` into a temporary folder and imported from
there; `.` is the working tree as it is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = (("decode 1", 1), ("decode 32", 32), ("prefill 512", 512))  # (name, tokens a step)


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) of the least-squares line y = a + b x through (x, y) points (two distinct x at
    least)."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    if sxx == 0:
        raise ValueError("a line needs two distinct x values")
    b = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    return mean_y - b * mean_x, b


# ---- one round, in the revision's tree (imports kvfleet from there) ---------------------------


def measure(steps: int, threads: int | None, dtype: str = "auto", model: str | None = None) -> dict:
    """Step times of each scenario, in seconds: {"wall": {name: [...]}, "cpu": {...}}."""
    import torch

    from kvfleet.shared.models import DEFAULT_MODEL, resolve_model_path
    from kvfleet.shared.wire import SamplingParams
    from kvfleet.worker.engine.engine import Engine, EngineConfig

    if threads:
        torch.set_num_threads(threads)
    engine = Engine.from_pretrained(resolve_model_path(model or DEFAULT_MODEL), EngineConfig(
        device="cpu", dtype=dtype, max_batched_tokens=512, max_running=64))
    rng = random.Random(0)  # the same prompts in every round and revision

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    tokens_of: dict[str, list[int]] = {}  # every request's tokens: the same in both revisions

    def step() -> None:
        for out in engine.step():
            tokens_of.setdefault(out.req_id, []).extend(out.new_token_ids)

    def timed(name: str) -> None:
        w, c = time.perf_counter(), time.process_time()
        step()
        wall.setdefault(name, []).append(time.perf_counter() - w)
        cpu.setdefault(name, []).append(time.process_time() - c)

    for name, tokens in SCENARIOS:
        if name.startswith("decode"):
            ids = [f"{name}-{i}" for i in range(tokens)]
            for req_id in ids:
                engine.add_request(req_id, prompt(128), params(steps + 16))
            while (engine.stats().num_waiting
                   or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running)):
                step()
            step()  # warm-up
            for _ in range(steps):
                timed(name)
            for req_id in ids:
                engine.abort(req_id)
        else:
            for i in range(max(3, steps // 3)):
                engine.add_request(f"{name}-{i}", prompt(tokens), params(1))
                timed(name)
                while engine.has_unfinished():
                    step()
    digest = hashlib.sha256(json.dumps(sorted(tokens_of.items())).encode()).hexdigest()[:16]
    return {"wall": wall, "cpu": cpu, "threads": torch.get_num_threads(), "tokens": digest}


# ---- the rounds -------------------------------------------------------------------------------


def export(revision: str, into: Path) -> Path:
    """The tree of `revision` in a folder (`.`: this working tree)."""
    if revision == ".":
        return ROOT
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run_round(tree: Path, steps: int, threads: int | None, dtype: str = "auto",
              model: str | None = None) -> dict:
    """One round in a process of its own that imports kvfleet from `tree`."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--steps", str(steps),
               "--dtype", dtype] + (["--model", model] if model else [])
    if threads:
        command += ["--threads", str(threads)]
    before = os.getloadavg()
    done = subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["load"] = [before, os.getloadavg()]
    return result


def medians(rounds: list[dict], kind: str) -> dict[str, float]:
    """Each scenario's median step (ms) over every step of every round, and `a`: the median of
    the rounds' intercepts (each round's line through its scenarios' medians)."""
    out = {name: statistics.median(t for r in rounds for t in r[kind][name]) * 1e3
           for name, _ in SCENARIOS}
    intercepts = [fit_line([(tokens, statistics.median(r[kind][name]) * 1e3)
                            for name, tokens in SCENARIOS])[0] for r in rounds]
    out["a"] = statistics.median(intercepts)
    out["b"] = statistics.median(
        fit_line([(tokens, statistics.median(r[kind][name]) * 1e3)
                  for name, tokens in SCENARIOS])[1] for r in rounds)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--revisions", nargs=2, default=["main", "."], metavar=("A", "B"),
                   help="git revisions to compare (`.`: the working tree)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per revision, alternated")
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per scenario")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--dtype", default="auto", help="the engine's --dtype (default: auto)")
    p.add_argument("--model", default=None,
                   help="the model (default: the default model; `random:<shape>` for a shape)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.steps, args.threads, args.dtype, args.model)))
        return 0
    results: dict[str, list[dict]] = {r: [] for r in args.revisions}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {r: export(r, Path(tmp) / f"rev{i}") for i, r in enumerate(args.revisions)}
        print(f"# load averages at the start: {os.getloadavg()}", flush=True)
        for round_ in range(args.rounds):
            for revision in args.revisions:
                result = run_round(trees[revision], args.steps, args.threads, args.dtype,
                                   args.model)
                results[revision].append(result)
                loads = " -> ".join("/".join(f"{x:.2f}" for x in load) for load in result["load"])
                steps = " / ".join(f"{statistics.median(result['wall'][name]) * 1e3:.1f}"
                                   for name, _ in SCENARIOS)
                print(f"# round {round_ + 1} {revision}: decode 1 / 32 / prefill 512 {steps} ms; "
                      f"load {loads}; tokens {result['tokens']}", flush=True)
    threads = results[args.revisions[0]][0]["threads"]
    print(f"\n{args.rounds} rounds per revision, alternated; {threads} torch threads; --dtype "
          f"{args.dtype}; medians, ms")
    print("| revision | time | decode 1 | decode 32 | prefill 512 | a (fixed) | b (per token) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for kind in ("wall", "cpu"):
        for revision in args.revisions:
            m = medians(results[revision], kind)
            print(f"| {revision} | {kind} | {m['decode 1']:.1f} | {m['decode 32']:.1f} | "
                  f"{m['prefill 512']:.1f} | {m['a']:.1f} | {m['b']:.3f} |")
    print(f"# load averages at the end: {os.getloadavg()}")
    digests = {r["tokens"] for rounds in results.values() for r in rounds}
    print("# every round generated the same tokens" if len(digests) == 1 else
          f"# the rounds' tokens differ: {sorted(digests)}")
    return 0 if len(digests) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
