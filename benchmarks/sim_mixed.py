"""A fleet of two accelerator kinds at the promised pace against the sum of each kind alone
(issue 51, item 7: "a fleet of mixed H100 and A100 workers at pace against the sum of each
alone", target at least 0.9x), on simulated workers.

    .venv/bin/python -m benchmarks.sim_mixed                     # 8 H100 + 8 A100, Llama-3.1-8B
    .venv/bin/python -m benchmarks.sim_mixed --per-kind 4 --duration 30 --target-itl-ms 40

Three fleets in turn, each on its own embedded Redis with one gateway: `--per-kind` simulated H100
workers alone, as many A100 workers alone, and both kinds together (two `kvfleet worker
--sim-workers N --sim-device KIND` processes). Every worker promises the same `--target-itl-ms`
(the pace: a worker admits only the streams it serves at that pace, so an A100 takes fewer than
an H100, not slower ones). The same closed loop of `--streams` non-streamed completions (more
than the fleet runs at pace, so that each fleet is full) runs against each; after `--warmup`
seconds the workers' counters are read, and again `--duration` seconds later: the tokens the
fleet generated in that window (the steady state, not the time to finish a batch of requests)
and the worst worker's ITL p99 (the pace's own window), in modelled time. Printed: each fleet's
output tokens/s, and the mixed fleet over the sum of the two alone.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.sim_pace import PaceRow, load, summarise
from benchmarks.sim_fleet import SimFleet, kvfleet
from kvfleet.shared.redis_server import free_port

TARGET_RATIO = 0.9
FULL_SHARE = 0.95  # a fleet running this share of the streams sent may have room for more


def run_fleet(args, kinds: list[str], log_dir: Path) -> PaceRow:
    k = args.time_scale
    port = free_port()
    name = "+".join(kinds)
    # the gateway's queue-wait limit is real time: off, the closed loop bounds the queue
    commands = {f"{name}-gateway": kvfleet("gateway", "--port", str(port),
                                           "--max-queue-wait-s", "0")}
    for kind in kinds:
        commands[f"{name}-{kind}"] = kvfleet(
            "worker", "--sim-workers", str(args.per_kind), "--sim-device", kind,
            "--sim-time-scale", str(k), "--worker-id", kind, "--metrics-port", "-1",
            "--tensor-parallel-size", str(args.tensor_parallel))
    env = {"KVFLEET_MODEL": args.model, "KVFLEET_TARGET_ITL_MS": str(args.target_itl_ms)}
    with SimFleet(commands, env, log_dir) as fleet:
        url, marks = f"http://127.0.0.1:{port}", {}
        fleet.wait_ready(args.per_kind * len(kinds), [url])

        def mark(name: str) -> None:  # the fleet's counters at the window's ends
            marks[name] = (fleet.beats(), time.perf_counter())

        asyncio.run(load(url, args.model, args.streams, args.warmup + args.duration,
                         args.prompt_tokens, args.output_tokens, args.seed, lambda: mark("end"),
                         [(args.warmup, lambda: mark("start"))]))
    (before, started), (after, ended) = marks["start"], marks["end"]
    row = summarise(name, before, after, ended - started, k, 0, 0)
    return dataclasses.replace(row, running=sum(b.running for b in after))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.1f}"


def report(results: dict[str, PaceRow], args) -> str:
    lines = [f"{args.per_kind} simulated workers a kind, {args.model} at TP {args.tensor_parallel}, "
             f"pace {args.target_itl_ms:g} ms; {args.streams} streams of {args.prompt_tokens} + "
             f"{args.output_tokens} tokens for {args.duration:g} s at time scale "
             f"{args.time_scale:g}",
             "| fleet | modelled out tok/s | worst worker's ITL p99 ms | streams running at the "
             "end | lag share |",
             "|---|---:|---:|---:|---:|"]
    bounded = []
    for name, r in results.items():
        lag = f"{r.counts.share:.1%}" + ("" if r.counts.valid else " INVALID")
        lines.append(f"| {name} | {r.tokens_per_s:,.0f} | {r.itl_p99_s * 1000:.1f} | "
                     f"{r.running:,} | {lag} |")
        if r.running >= FULL_SHARE * args.streams:
            bounded.append(name)
    kinds = args.kinds.split(",")
    alone = sum(results[k].tokens_per_s for k in kinds)
    mixed = results["+".join(kinds)].tokens_per_s
    ratio = mixed / alone if alone else 0.0
    lines.append(f"mixed / sum of each alone: {ratio:.2f} (target at least {TARGET_RATIO}: "
                 f"{'met' if ratio >= TARGET_RATIO else 'NOT met'})")
    if bounded:  # the fleet ran (nearly) every stream sent: the client, not its room, bound it
        lines.append(f"not full: {', '.join(bounded)} ran {FULL_SHARE:.0%} or more of the "
                     f"{args.streams} streams sent; raise --streams")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="h100,a100")
    parser.add_argument("--per-kind", type=int, default=8)
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--target-itl-ms", type=float, default=40.0)
    parser.add_argument("--streams", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--warmup", type=float, default=30.0,
                        help="seconds of load, real, before the measured window")
    parser.add_argument("--duration", type=float, default=60.0,
                        help="seconds of the measured window, real")
    parser.add_argument("--time-scale", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="sim-mixed-"))
    kinds = args.kinds.split(",")
    results = {}
    for fleet in [[kind] for kind in kinds] + [kinds]:
        name = "+".join(fleet)
        results[name] = run_fleet(args, fleet, log_dir)
        print(f"{name}: {results[name].tokens_per_s:,.0f} modelled out tok/s",
              flush=True)
    print(report(results, args))
    print(f"logs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
