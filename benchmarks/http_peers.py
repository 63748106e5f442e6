"""kvfleet and vLLM side by side over HTTP: each server started in turn on this machine, timed to
its first answer, then the same `kvfleet bench` client replays the same trace against it.

The first N requests of the trace (default: benchmarks/data/chat-mix-64.jsonl, 64) are sent at
once (`--rate inf`) to /v1/completions with the raw prompts, greedy, each with its own max_tokens
and ignore_eos. kvfleet runs as `kvfleet up` (embedded Redis, gateway, one worker); vLLM as its
OpenAI server from its own virtualenv (benchmarks/vllm_env.sh; skipped with a message without it),
"tuned" by default (every core, tcmalloc + Intel OpenMP: benchmarks/vllm_peer.py). Neither
server gets this shell's OpenMP, math-library or allocator variables (OMP_*, GOMP_*, KMP_*,
LD_PRELOAD, MALLOC_*, ...: benchmarks/peer_env.py; the header names those dropped): `kvfleet up`
gives its worker its own OpenMP settings, as a user's fleet gets them, and vLLM its own setup.

    .venv/bin/python -m benchmarks.http_peers                       # kvfleet auto vs vLLM bf16
    .venv/bin/python -m benchmarks.http_peers --kvfleet-dtypes auto,float32 \\
        --vllm-dtypes bfloat16,float32
    .venv/bin/python -m benchmarks.http_peers --repeats 3    # 3 rounds, the servers alternated
    .venv/bin/python -m benchmarks.http_peers --model random:llama-3.2-1b --num-requests 32
    .venv/bin/python -m benchmarks.http_peers --model random:llama-3.2-1b --num-requests 8 \
        --concurrency 1                                      # one stream at a time

On a shared machine a server's throughput drifts between runs minutes apart by more than the
difference being measured. With `--repeats N` every system runs once per round, in the same
order, N rounds (kvfleet, vLLM, kvfleet, vLLM, ...): the table gives each system's medians, the
ratio of kvfleet's median to each system's, the median over the rounds of each round's ratio
(the runs compared ran minutes apart, not N minutes apart) and every round's ratio.

After the table, the trace's **floor** on this machine (benchmarks/serve_floor.py): the least time
any server needs for these requests (their prompts as /v1/completions tokenises them, their
max_tokens made, all in flight at once or `--concurrency` at a time), from the peak product rate
and read bandwidth measured before the first round; each system's median throughput is given as
its share of the ceiling that gives, with whether 1.5x vLLM's (issue 55's target for this trace)
is within it at all. `--no-floor` skips it.

Every request must succeed: the table counts each system's failed requests (over all rounds),
and the run exits 1 after printing it when any failed (a server that cannot start or a client
that cannot run stops the run at once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.peer_env import dropped_line, peer_env
from benchmarks.serve_floor import Ceilings, Workload, measure as measure_ceilings, reachable
from benchmarks.vllm_peer import REPO, SETUP_HINT, SETUPS, VllmServer, describe_setup, vllm_python
from kvfleet.shared.cpu_features import cpu_features
from kvfleet.shared.models import DEFAULT_MODEL, resolve_model_path, served_model_id

WORKLOAD = str(REPO / "benchmarks" / "data" / "chat-mix-64.jsonl")
TARGET = 1.5  # issue 55: kvfleet's output tok/s on this trace at least this times vLLM's


@dataclass
class HttpResult:
    name: str
    startup_s: float  # process start to the first answered request
    output_tokens: int
    seconds: float
    tokens_per_s: float
    ttft_p50_s: float | None
    num_requests: int = 0  # sent by the client
    num_errors: int = 0  # of those, failed
    first_error: str | None = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_first_answer(url: str, model: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Poll a one-token completion until the server answers it (or its process dies)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with code {process.returncode}")
        try:
            reply = httpx.post(f"{url}/v1/completions", timeout=30, json={
                "model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0.0})
            if reply.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no answer from {url} within {timeout_s:.0f} s")


def run_client(url: str, args, out_dir: Path) -> dict:
    """`kvfleet bench` against `url`; its summary, failed requests included (it exits 1 when
    any failed, having written results.json; any other failure raises)."""
    command = [sys.executable, "-m", "kvfleet", "bench", args.workload, "--url", url,
               "--endpoint", "completions", "--rate", "inf", "--num-requests",
               str(args.num_requests), "--no-plots", "--no-progress", "--out", str(out_dir),
               "--timeout", "3600", "--temperature", "0", "--model", served_model_id(args.model)]
    if args.concurrency:
        command += ["--concurrency", str(args.concurrency)]
    results = out_dir / "results.json"
    results.unlink(missing_ok=True)  # a --log-dir may hold an earlier run's
    done = subprocess.run(command, cwd=REPO)
    if done.returncode not in (0, 1) or not results.exists():
        raise RuntimeError(f"kvfleet bench against {url} exited with code {done.returncode}")
    return json.loads(results.read_text())["summary"]


def kvfleet_server(port: int, dtype: str, log_path: Path, model: str = DEFAULT_MODEL,
                   extra: list[str] | None = None,
                   redis_port: int | None = None) -> subprocess.Popen:
    """`kvfleet up` in a session of its own, so that stopping it reaches its children; `extra`
    arguments for it, its embedded Redis on `redis_port` (default: a free port)."""
    command = [sys.executable, "-m", "kvfleet", "up", "--port", str(port), "--dtype", dtype,
               "--workers", "1", "--model", model, *(extra or ())]
    # every request of the trace is sent at once and must be served, as vLLM serves them: the
    # gateway's expected-wait admission limit (429 beyond 60 s by default) is off here
    env = peer_env({"KVFLEET_EMBEDDED_REDIS_PORT": str(redis_port or free_port()),
                    "KVFLEET_MAX_QUEUE_WAIT_S": "0"})
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop_session(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def measure(name: str, url: str, model: str, process, started: float, args, out_dir: Path) -> HttpResult:
    wait_first_answer(url, model, process, args.startup_timeout_s)
    startup_s = time.perf_counter() - started
    print(f"  {name}: first answer {startup_s:.1f} s after start", flush=True)
    summary = run_client(url, args, out_dir)
    result = HttpResult(name, startup_s, summary["total_output_tokens"], summary["duration_s"],
                        summary["output_tokens_per_s"], summary["ttft_s"]["p50"],
                        summary["num_requests"], summary["num_errors"],
                        next(iter(summary["errors"]), None))
    failed = (f"; {result.num_errors} of {result.num_requests} requests FAILED "
              f"({result.first_error})" if result.num_errors else "")
    print(f"  {name}: {result.tokens_per_s:.1f} output tok/s{failed}", flush=True)
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default=WORKLOAD)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="what both serve: the default model, a directory, or random:<shape> "
                        "(the same random weights for both: shared/model_shapes.py)")
    p.add_argument("--concurrency", type=int, default=0,
                   help="streams at once, each client sending its next request when its last "
                        "is answered (0: every request at once)")
    p.add_argument("--kvfleet-dtypes", default="auto")
    p.add_argument("--vllm-dtypes", default="bfloat16")
    p.add_argument("--vllm-venv", default=None)
    p.add_argument("--vllm-setups", default="tuned",
                   help="vLLM servers at each dtype, one per setup: tuned (its CPU guide's: every "
                        "core, tcmalloc + Intel OpenMP) and/or defaults")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds; every system runs once per round, and the table gives "
                        "medians (of throughputs, and of each round's ratios)")
    p.add_argument("--no-floor", action="store_true",
                   help="skip measuring this machine's ceilings and the trace's floor")
    p.add_argument("--startup-timeout-s", type=float, default=600)
    p.add_argument("--json-out", default=None)
    p.add_argument("--log-dir", default=None,
                   help="keep the servers' logs and the client's results here (default: a "
                        "temporary directory, removed)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    model_dir = resolve_model_path(args.model)
    vllm = vllm_python(args.vllm_venv) if args.vllm_dtypes else None
    at_once = f"{args.concurrency} at a time" if args.concurrency else "all at once"
    print(f"# CPU {cpu_features().describe()}; model {args.model}; {args.num_requests} requests "
          f"of {Path(args.workload).name}, {at_once}, /v1/completions; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    if dropped := dropped_line():
        print(dropped, flush=True)
    if vllm is None and args.vllm_dtypes:
        print(f"# vLLM skipped: no virtualenv with vllm found; {SETUP_HINT}", flush=True)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    setups = [s for s in args.vllm_setups.split(",") if s]
    if unknown := set(setups) - set(SETUPS):
        raise SystemExit(f"--vllm-setups: unknown {sorted(unknown)}; choose from {SETUPS}")
    ceilings = None
    if not args.no_floor:  # measured first, on a quiet machine, before any server starts
        ceilings = measure_ceilings(args.model)
        print(f"# this machine's ceilings for {args.model}:\n{ceilings.describe()}", flush=True)
    rounds: list[list[HttpResult]] = []
    with tempfile.TemporaryDirectory(prefix="kvfleet-http-peers-") as tmp:
        if args.log_dir:
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            tmp = args.log_dir
        for round_index in range(args.repeats):
            if args.repeats > 1:
                print(f"# round {round_index + 1} of {args.repeats}; load average "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
            tag = f"-{round_index + 1}" if args.repeats > 1 else ""
            rounds.append(run_round(args, vllm, model_dir, setups, Path(tmp), tag))
    print_table(rounds)
    if ceilings is not None:
        print("\n".join(floor_lines(rounds, ceilings, trace_workload(args, model_dir))))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            [[r.__dict__ for r in results] for results in rounds] if args.repeats > 1
            else [r.__dict__ for r in rounds[0]], indent=2))
    return report_failures(rounds)


def trace_workload(args, model_dir: str) -> Workload:
    """The requests the client sends, as the floor counts them: each prompt as /v1/completions
    tokenises it, its max_tokens made (ignore_eos), no prompt cached, all in flight at once or
    --concurrency at a time."""
    from benchmarks.engine_throughput import load_requests  # the engine's imports: here only
    from kvfleet.shared.models import load_tokenizer

    requests = load_requests(args.workload, args.num_requests, load_tokenizer(model_dir), raw=True)
    return Workload(tuple(len(r.prompt) for r in requests),
                    tuple(r.max_tokens for r in requests), (0,) * len(requests),
                    args.concurrency or len(requests))


def floor_lines(rounds: list[list[HttpResult]], ceilings: Ceilings, workload: Workload,
                target: float = TARGET) -> list[str]:
    """The trace's floor, and each system's median throughput as its share of the ceiling;
    whether `target` times the best vLLM system is within the ceiling."""
    result = ceilings.floor(workload)
    lines = [f"\nthe trace's {result.describe()}"]
    names = dict.fromkeys(r.name for results in rounds for r in results)
    shares = {name: result.share(statistics.median(
        r.tokens_per_s for results in rounds for r in results if r.name == name))
        for name in names}
    lines += [f"  {name}: {share:.0%} of the ceiling" for name, share in shares.items()]
    peers = [share for name, share in shares.items() if name.startswith("vLLM")]
    if peers:
        peer = max(peers)
        lines.append(f"  {target}x vLLM's best would be {target * peer:.0%} of the ceiling: "
                     + ("within it" if reachable(target, peer) else "beyond this machine"))
    return lines


def report_failures(rounds: list[list[HttpResult]]) -> int:
    """1, after a line per system with failed requests, when any request of any run failed."""
    failed = [r for results in rounds for r in results if r.num_errors]
    for r in failed:
        print(f"FAILED: {r.name}: {r.num_errors} of {r.num_requests} requests failed "
              f"({r.first_error})", flush=True)
    return 1 if failed else 0


def run_round(args, vllm: Path | None, model_dir: str, setups: list[str], tmp: Path,
              tag: str) -> list[HttpResult]:
    """Every system once: kvfleet at each of its dtypes, then vLLM at each dtype and setup."""
    results = []
    for dtype in filter(None, args.kvfleet_dtypes.split(",")):
        port = free_port()
        started = time.perf_counter()
        process = kvfleet_server(port, dtype, tmp / f"kvfleet-{dtype}{tag}.log", args.model)
        try:
            results.append(measure(f"kvfleet, --dtype {dtype}", f"http://127.0.0.1:{port}",
                                   served_model_id(args.model), process, started, args,
                                   tmp / f"kvfleet-{dtype}{tag}"))
        finally:
            stop_session(process)
    runs = [(d, s) for d in filter(None, args.vllm_dtypes.split(",")) for s in setups]
    for dtype, setup in runs if vllm else ():
        print(f"# vLLM setup {setup}: {describe_setup(vllm, setup)}", flush=True)
        name = f"vllm-{dtype}-{setup}"
        server = VllmServer(vllm, model_dir, free_port(), dtype, tmp / f"{name}{tag}.log",
                            served_name=served_model_id(args.model), setup=setup)
        try:
            label = f"vLLM, --dtype {dtype}" + (f", {setup}" if len(setups) > 1 else "")
            results.append(measure(label, server.url, served_model_id(args.model), server.process,
                                   server.started, args, tmp / f"{name}{tag}"))
        finally:
            server.stop()
    return results


@dataclass
class Row:
    """One system over the rounds: medians, and its ratios to kvfleet's fastest system."""
    name: str
    rounds: int
    startup_s: float
    output_tokens: int
    seconds: float
    tokens_per_s: float
    all_tokens_per_s: list[float]
    ttft_p50_s: float | None
    ratio_of_medians: float  # kvfleet's best median / this system's median
    ratio: float  # median over the rounds of (kvfleet's best of the round) / this system
    all_ratios: list[float]
    num_requests: int  # over the rounds
    num_errors: int


def summarize(rounds: list[list[HttpResult]]) -> tuple[str, list[Row]]:
    """kvfleet's fastest system (the highest median), and per system (in the order of the first
    round) its medians over the rounds, the ratio of that one's median to its median, and the
    median of each round's ratio of that one to it."""
    names = [r.name for r in rounds[0]]
    by_name = {name: [r for results in rounds for r in results if r.name == name]
               for name in names}
    medians = {name: statistics.median(r.tokens_per_s for r in runs)
               for name, runs in by_name.items()}
    ours = [name for name in names if name.startswith("kvfleet")]
    if not ours:
        return "", []
    best = max(ours, key=medians.__getitem__)
    rows = []
    for name in names:
        runs = by_name[name]
        ratios = [ours_run.tokens_per_s / run.tokens_per_s
                  for results in rounds
                  for ours_run in results if ours_run.name == best
                  for run in results if run.name == name]
        ttfts = [r.ttft_p50_s for r in runs if r.ttft_p50_s is not None]
        rows.append(Row(name, len(runs), statistics.median(r.startup_s for r in runs),
                        runs[0].output_tokens, statistics.median(r.seconds for r in runs),
                        medians[name], [r.tokens_per_s for r in runs],
                        statistics.median(ttfts) if ttfts else None,
                        medians[best] / medians[name], statistics.median(ratios), ratios,
                        sum(r.num_requests for r in runs), sum(r.num_errors for r in runs)))
    return best, rows


def print_table(rounds: list[list[HttpResult]]) -> None:
    best, rows = summarize(rounds)
    if not rows:
        return
    several = len(rounds) > 1
    median = "median " if several else ""
    print(f"\n| system | {median}start-up to first answer (s) | output tokens | {median}seconds | "
          f"{median}output tok/s | {median}TTFT p50 (s) | failed requests | {best} is"
          + (" (ratio of medians) | median of the rounds' ratios | every round's tok/s | "
             "every round's ratio |" if several else " |"))
    print("|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---|---|" if several else ""))
    for r in rows:
        ttft = f"{r.ttft_p50_s:.1f}" if r.ttft_p50_s is not None else "-"
        line = (f"| {r.name} | {r.startup_s:.1f} | {r.output_tokens} | {r.seconds:.1f} | "
                f"{r.tokens_per_s:.1f} | {ttft} | {r.num_errors} of {r.num_requests} | "
                f"{r.ratio_of_medians:.2f}x |")
        if several:
            line += (f" {r.ratio:.2f}x | {' / '.join(f'{t:.1f}' for t in r.all_tokens_per_s)} | "
                     f"{' / '.join(f'{x:.2f}' for x in r.all_ratios)} |")
        print(line)


if __name__ == "__main__":
    sys.exit(main())
