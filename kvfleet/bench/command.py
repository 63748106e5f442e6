"""`kvfleet bench TRACE.jsonl --url URL`: replay a recorded prompt trace against a running
OpenAI-compatible server with streaming requests, and report the seed's four numbers (TTFT,
tokens/s per stream, tokens/s per accelerator, cost per token), latency percentiles and SLO
goodput; `--sweep` raises the load until goodput falls below a target."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import sys
from collections import Counter
from pathlib import Path

import httpx

from kvfleet.bench.client import ENDPOINT_PATHS, BenchTarget, RequestRecord
from kvfleet.bench.loadgen import CANCELLED_AT_LIMIT, LoadSpec, RunResult, replay
from kvfleet.text import arg_types
from kvfleet.bench.probe import (
    FleetUnreachable, count_workers, resolve_model, speculation_counts, speculation_summary)
from kvfleet.bench.report import (
    speculation_line, summary_to_text, sweep_to_text, write_results, write_sweep)
from kvfleet.bench.stats import Slo, Summary, summarise
from kvfleet.bench.sweep import SWEEP_BY_CHOICES, SweepResult, default_loads, sweep
from kvfleet.bench.trace import TraceError, TraceRequest, load_trace
from kvfleet.shared.cpu_features import cpu_features

EXIT_FAILED = 1  # any request failed (results.json is still written)
EXIT_ALL_FAILED = EXIT_FAILED
EXIT_USAGE = 2
_CONNECT_TIMEOUT_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", metavar="TRACE.jsonl",
                        help='one {"t", "prompt", "max_tokens", "ignore_eos"} object per line')
    _add_target_arguments(parser)
    _add_load_arguments(parser)
    _add_report_arguments(parser)
    _add_sweep_arguments(parser)


def _add_target_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--url", type=arg_types.http_url, default="http://127.0.0.1:8000",
                       help="base URL of the server (default: http://127.0.0.1:8000)")
    group.add_argument("--model", default=None,
                       help="model to request (default: the first id of GET /v1/models)")
    group.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="chat",
                       help="chat: /v1/chat/completions; completions: /v1/completions")
    group.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                       help="bearer token (default: $OPENAI_API_KEY, if set)")
    group.add_argument("--timeout", type=arg_types.positive_float, default=300.0,
                       help="seconds one request may take in all (default: 300)")
    group.add_argument("--temperature", type=arg_types.non_negative_float, default=None,
                       help="sent with every request (0 = greedy); default: not sent, the "
                            "server's default applies")


def _add_load_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("load")
    group.add_argument("--rate", type=arg_types.positive_float_or_inf, default=None,
                       help="speed-up of the trace's arrival times: 2 = twice as fast, inf = "
                            "all at once (default: 1, or inf with --concurrency)")
    group.add_argument("--concurrency", type=arg_types.positive_int, default=None,
                       help="at most N requests in flight; alone it is a closed loop")
    group.add_argument("--num-requests", type=arg_types.positive_int, default=None,
                       help="replay only the first N requests of the trace")
    group.add_argument("--duration-limit", type=arg_types.positive_float, default=None,
                       help="seconds after which no request is sent and running ones are "
                            "cancelled (counted as failed)")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_report_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("report")
    group.add_argument("--num-workers", type=arg_types.positive_int, default=None,
                       help="accelerators serving (default: the count GET /health reports, "
                            "else 1)")
    group.add_argument("--cost-per-hour", type=arg_types.non_negative_float, default=None,
                       help="$ per accelerator-hour, for the cost per 1M output tokens")
    group.add_argument("--slo-ttft-s", type=arg_types.positive_float, default=2.0,
                       help="SLO: first token within this many seconds (default: 2.0)")
    group.add_argument("--slo-tokens-per-s", type=arg_types.non_negative_float, default=20.0,
                       help="SLO: stream pace of at least this (default: 20 tokens/s)")
    group.add_argument("--out", type=Path, default=Path("bench-out"),
                       help="directory for results.json and plots (default: bench-out/)")
    group.add_argument("--no-plots", action="store_true", help="write no PNG plots")


def _add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sweep")
    group.add_argument("--sweep", action="store_true",
                       help="run at increasing load until SLO goodput drops below "
                            "--sweep-goodput; report the largest load that met it")
    group.add_argument("--sweep-by", choices=SWEEP_BY_CHOICES, default=None,
                       help="what to raise (default: concurrency if --concurrency, else rate)")
    group.add_argument("--sweep-loads", type=arg_types.positive_float_list, default=None,
                       help="loads to try, e.g. 0.5,1,2,4 (default: rates 0.25..64 or "
                            "concurrency 1..512, doubling)")
    group.add_argument("--sweep-goodput", type=arg_types.fraction, default=0.9,
                       help="goodput a load must keep to pass (default: 0.9)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfleet bench", description=__doc__)
    add_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        requests = load_trace(args.trace, args.num_requests)
        return asyncio.run(_bench(args, requests))
    except (TraceError, FleetUnreachable) as exc:
        return _fail(str(exc))
    except OSError as exc:  # e.g. --out not writable
        return _fail(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))
    except KeyboardInterrupt:
        return _fail("interrupted")


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


async def _bench(args: argparse.Namespace, requests: list[TraceRequest]) -> int:
    args.out.mkdir(parents=True, exist_ok=True)  # fail before the run, not after it
    async with _client(args, len(requests)) as client:
        target = BenchTarget(await resolve_model(client, args.model), args.endpoint, args.timeout,
                             args.temperature)
        num_workers = args.num_workers or await count_workers(client)
        info = _run_info(args, target, num_workers)
        num_workers = num_workers or 1

        async def run_at(load: LoadSpec) -> tuple[RunResult, Summary]:
            result = await _replay_with_progress(client, target, requests, load, args)
            return result, summarise(result, _slo(args), num_workers, args.cost_per_hour)

        if args.sweep:
            return await _sweep(args, run_at, info)
        before = await speculation_counts(client, target.model)
        result, summary = await run_at(_base_load(args))
        info["speculation"] = speculation_summary(
            before, await speculation_counts(client, target.model))
    return _report_run(args, result, summary, info)


def _client(args: argparse.Namespace, num_requests: int) -> httpx.AsyncClient:
    """One client for the whole run, with room for every request to stream at once."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(num_requests, 20))
    timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, _CONNECT_TIMEOUT_S))
    return httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits,
                             timeout=timeout)


async def _replay_with_progress(client: httpx.AsyncClient, target: BenchTarget,
                                requests: list[TraceRequest], load: LoadSpec,
                                args: argparse.Namespace) -> RunResult:
    from tqdm import tqdm

    with tqdm(total=len(requests), desc=load.label(), unit="req", file=sys.stderr,
              disable=args.no_progress, leave=False) as progress:
        return await replay(client, target, requests, load, lambda: progress.update(1))


async def _sweep(args: argparse.Namespace, run_at, info: dict) -> int:
    sweep_by = args.sweep_by or ("concurrency" if args.concurrency else "rate")
    loads = args.sweep_loads or default_loads(sweep_by)
    base = _base_load(args, closed_loop=sweep_by == "concurrency")
    result = await sweep(run_at, base, sweep_by, loads, args.sweep_goodput)
    _write_sweep_files(args, result, info)
    print(sweep_to_text([s.summary for s in result.steps], [s.load for s in result.steps],
                        sweep_by, result.best_load, args.sweep_goodput), end="")
    print(f"wrote {args.out / 'sweep.json'}")
    if not any(s.summary.num_ok for s in result.steps):
        return _all_failed(result.steps[0].summary)
    # the load that broke the SLO ended the sweep: its failures are the measurement; a failure
    # at a load reported as meeting it is not
    passed = [s for s in result.steps if result.best_load is not None
              and s.load <= result.best_load]
    for step in passed:
        if code := _some_failed(step.result.records, f" at {sweep_by} {step.load:g}"):
            return code
    return 0


def _write_sweep_files(args: argparse.Namespace, result: SweepResult, info: dict) -> None:
    summaries = [step.summary for step in result.steps]
    loads = [step.load for step in result.steps]
    for step in result.steps:
        write_results(args.out / f"{result.sweep_by}-{step.load:g}", step.summary,
                      step.result.records, info)
    write_sweep(args.out, summaries, loads, result.sweep_by, result.best_load, info)
    if not args.no_plots:
        from kvfleet.bench.plots import plot_sweep

        plot_sweep(loads, summaries, result.sweep_by, result.goodput_target,
                   args.out / "sweep.png")


def _report_run(args: argparse.Namespace, result: RunResult, summary: Summary,
                info: dict) -> int:
    paths = [write_results(args.out, summary, result.records, info)]
    if not args.no_plots:
        from kvfleet.bench.plots import plot_latency_cdfs, plot_throughput

        paths.append(plot_latency_cdfs(result.records, args.out / "latency_cdf.png"))
        paths.append(plot_throughput(result.records, result.duration_s,
                                     args.out / "throughput.png"))
    print(f"Client CPU: {info['client_cpu']}")
    print(summary_to_text(summary), end="")
    print(speculation_line(info.get("speculation")))
    print("wrote " + ", ".join(str(path) for path in paths))
    return _some_failed(result.records) if summary.num_ok else _all_failed(summary)


def _base_load(args: argparse.Namespace, closed_loop: bool = False) -> LoadSpec:
    """--rate as given; else inf (closed loop) with a concurrency cap, else the trace's pace."""
    rate = args.rate
    if rate is None:
        rate = math.inf if (args.concurrency or closed_loop) else 1.0
    return LoadSpec(rate, args.concurrency, args.duration_limit)


def _slo(args: argparse.Namespace) -> Slo:
    return Slo(ttft_s=args.slo_ttft_s, tokens_per_s=args.slo_tokens_per_s)


def _run_info(args: argparse.Namespace, target: BenchTarget, num_workers: int | None) -> dict:
    return {
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "url": args.url, "model": target.model, "endpoint": target.endpoint,
        "trace": str(args.trace), "num_requests": args.num_requests,
        "rate": None if args.rate is None else str(args.rate) if math.isinf(args.rate)
        else args.rate,
        "concurrency": args.concurrency,
        "num_workers": num_workers or 1,
        "num_workers_source": "--num-workers" if args.num_workers else
        ("GET /health" if num_workers else "assumed 1"),
        "cost_per_hour": args.cost_per_hour, "timeout_s": args.timeout,
        # the machine the client runs on (the server's too when both share it, as in
        # benchmarks/http_peers.py): results differ by CPU kind, so every result names it
        "client_cpu": cpu_features().describe(),
    }


def _all_failed(summary: Summary) -> int:
    first_error = next(iter(summary.errors), "no request was sent")
    print(f"kvfleet bench: every request failed: {first_error}", file=sys.stderr)
    return EXIT_FAILED


def _some_failed(records: list[RequestRecord], where: str = "") -> int:
    """EXIT_FAILED, with a line saying how many failed and the commonest error, when any
    request failed other than those cancelled at --duration-limit (the limit the operator
    set); else 0."""
    errors = Counter(r.error or "ended without [DONE]" for r in records
                     if not r.ok and r.error != CANCELLED_AT_LIMIT)
    if not errors:
        return 0
    print(f"kvfleet bench: {errors.total()} of {len(records)} requests failed{where}: "
          f"{errors.most_common(1)[0][0]}", file=sys.stderr)
    return EXIT_FAILED


def _fail(message: str) -> int:
    print(f"kvfleet bench: error: {message}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
