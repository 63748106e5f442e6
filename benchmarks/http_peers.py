"""kvfleet and vLLM side by side over HTTP: each server started in turn on this machine, timed to
its first answer, then the same `kvfleet bench` client replays the same trace against it.

The first N requests of the trace (default: ../shared/workloads/chat-mix.jsonl, 64) are sent at
once (`--rate inf`) to /v1/completions with the raw prompts, greedy, each with its own max_tokens
and ignore_eos. kvfleet runs as `kvfleet up` (embedded Redis, gateway, one worker); vLLM as its
OpenAI server from its own virtualenv (benchmarks/vllm_env.sh; skipped with a message without it),
"tuned" by default (every core, tcmalloc + Intel OpenMP: benchmarks/vllm_peer.py). Leave
OMP_WAIT_POLICY and GOMP_SPINCOUNT unset: `kvfleet up` then gives its worker its own OpenMP
settings, as a user's fleet gets them (a policy set here would be kept instead).

    .venv/bin/python -m benchmarks.http_peers                       # kvfleet auto vs vLLM bf16
    .venv/bin/python -m benchmarks.http_peers --kvfleet-dtypes auto,float32 \\
        --vllm-dtypes bfloat16,float32
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.vllm_peer import REPO, SETUP_HINT, SETUPS, VllmServer, describe_setup, vllm_python
from shared.cpu_features import cpu_features
from shared.models import DEFAULT_MODEL, resolve_model_path

WORKLOAD = str(REPO.parent / "shared" / "workloads" / "chat-mix.jsonl")


@dataclass
class HttpResult:
    name: str
    startup_s: float  # process start to the first answered request
    output_tokens: int
    seconds: float
    tokens_per_s: float
    ttft_p50_s: float | None


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
    """`kvfleet bench` against `url`; its summary."""
    command = [sys.executable, "-m", "kvfleet", "bench", args.workload, "--url", url,
               "--endpoint", "completions", "--rate", "inf", "--num-requests",
               str(args.num_requests), "--no-plots", "--no-progress", "--out", str(out_dir),
               "--timeout", "3600", "--temperature", "0"]
    subprocess.run(command, check=True, cwd=REPO)
    return json.loads((out_dir / "results.json").read_text())["summary"]


def kvfleet_server(port: int, dtype: str, log_path: Path) -> subprocess.Popen:
    """`kvfleet up` in a session of its own, so that stopping it reaches its children."""
    command = [sys.executable, "-m", "kvfleet", "up", "--port", str(port), "--dtype", dtype,
               "--workers", "1"]
    # every request of the trace is sent at once and must be served, as vLLM serves them: the
    # gateway's expected-wait admission limit (429 beyond 60 s by default) is off here
    env = {**os.environ, "KVFLEET_EMBEDDED_REDIS_PORT": str(free_port()),
           "KVFLEET_MAX_QUEUE_WAIT_S": "0"}
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
                        summary["output_tokens_per_s"], summary["ttft_s"]["p50"])
    print(f"  {name}: {result.tokens_per_s:.1f} output tok/s", flush=True)
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default=WORKLOAD)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--kvfleet-dtypes", default="auto")
    p.add_argument("--vllm-dtypes", default="bfloat16")
    p.add_argument("--vllm-venv", default=None)
    p.add_argument("--vllm-setups", default="tuned",
                   help="vLLM servers at each dtype, one per setup: tuned (its CPU guide's: every "
                        "core, tcmalloc + Intel OpenMP) and/or defaults")
    p.add_argument("--startup-timeout-s", type=float, default=600)
    p.add_argument("--json-out", default=None)
    p.add_argument("--log-dir", default=None,
                   help="keep the servers' logs and the client's results here (default: a "
                        "temporary directory, removed)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    model_dir = resolve_model_path(DEFAULT_MODEL)
    vllm = vllm_python(args.vllm_venv) if args.vllm_dtypes else None
    print(f"# CPU {cpu_features().describe()}; {args.num_requests} requests of "
          f"{Path(args.workload).name}, all at once, /v1/completions; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    if vllm is None and args.vllm_dtypes:
        print(f"# vLLM skipped: no virtualenv with vllm found; {SETUP_HINT}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvfleet-http-peers-") as tmp:
        if args.log_dir:
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            tmp = args.log_dir
        for dtype in filter(None, args.kvfleet_dtypes.split(",")):
            port = free_port()
            started = time.perf_counter()
            process = kvfleet_server(port, dtype, Path(tmp) / f"kvfleet-{dtype}.log")
            try:
                results.append(measure(f"kvfleet, --dtype {dtype}", f"http://127.0.0.1:{port}",
                                       DEFAULT_MODEL, process, started, args,
                                       Path(tmp) / f"kvfleet-{dtype}"))
            finally:
                stop_session(process)
        setups = [s for s in args.vllm_setups.split(",") if s]
        if unknown := set(setups) - set(SETUPS):
            raise SystemExit(f"--vllm-setups: unknown {sorted(unknown)}; choose from {SETUPS}")
        runs = [(d, s) for d in filter(None, args.vllm_dtypes.split(",")) for s in setups]
        for dtype, setup in runs if vllm else ():
            print(f"# vLLM setup {setup}: {describe_setup(vllm, setup)}", flush=True)
            name = f"vllm-{dtype}-{setup}"
            server = VllmServer(vllm, model_dir, free_port(), dtype, Path(tmp) / f"{name}.log",
                                served_name=DEFAULT_MODEL, setup=setup)
            try:
                label = f"vLLM, --dtype {dtype}" + (f", {setup}" if len(setups) > 1 else "")
                results.append(measure(label, server.url, DEFAULT_MODEL, server.process,
                                       server.started, args, Path(tmp) / name))
            finally:
                server.stop()
    print_table(results)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([r.__dict__ for r in results], indent=2))
    return 0


def print_table(results: list[HttpResult]) -> None:
    ours = [r for r in results if r.name.startswith("kvfleet")]
    if not ours:
        return
    best = max(ours, key=lambda r: r.tokens_per_s)
    print(f"\n| system | start-up to first answer (s) | output tokens | seconds | output tok/s "
          f"| TTFT p50 (s) | {best.name} is |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        ttft = f"{r.ttft_p50_s:.1f}" if r.ttft_p50_s is not None else "-"
        print(f"| {r.name} | {r.startup_s:.1f} | {r.output_tokens} | {r.seconds:.1f} | "
              f"{r.tokens_per_s:.1f} | {ttft} | {best.tokens_per_s / r.tokens_per_s:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
