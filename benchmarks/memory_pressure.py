"""Keep or recompute under memory pressure: one trace, a KV pool too small for it, each
`--preemption` policy (recompute, swap, auto) in turn on the same model, rounds interleaved.

The trace is the first N requests of chat-mix (chat-templated prompts, their max_tokens,
ignore_eos, greedy) arriving at their trace times; the pool holds only `--kv-fraction` of the
tokens the requests reach at their peak, so streams are preempted again and again. Reported per
policy (medians over rounds): output tokens/s over the run, inter-token latency p50/p99 (the gap
between consecutive tokens of one stream, measured where the driver receives them, so a stream
paused by preemption shows its whole pause), TTFT p50, preemptions (and how many swapped), and
whether every policy produced exactly the same tokens (greedy: they must).

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 .venv/bin/python -m benchmarks.memory_pressure
    .venv/bin/python -m benchmarks.memory_pressure --num-requests 8 --rounds 1   # quick
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks.engine_throughput import WORKLOAD, greedy, load_model, load_requests
from kvfleet.shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from kvfleet.worker.engine.engine import Engine, EngineConfig

POLICIES = ("recompute", "swap", "auto")


@dataclass
class Run:
    policy: str
    seconds: float
    output_tokens: int
    preemptions: int
    swap_preemptions: int
    itl_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def itl(self, q: float) -> float:
        return percentile(self.itl_s, q)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else float("nan")


def run_policy(model, requests, arrivals: list[float], config: EngineConfig) -> Run:
    engine = Engine(copy.deepcopy(model), config)
    pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
    added_at: dict[int, float] = {}
    last_token_at: dict[int, float] = {}
    outputs: list[list[int]] = [[] for _ in requests]
    itl, ttft = [], []
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and arrivals[pending[0]] <= now:
            i = pending.pop(0)
            engine.add_request(str(i), requests[i].prompt, greedy(requests[i].max_tokens))
            added_at[i] = now
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[pending[0]] - now))
            continue
        step_outputs = engine.step()
        now = time.perf_counter() - start
        for out in step_outputs:
            i = int(out.req_id)
            for token in out.new_token_ids:
                outputs[i].append(token)
                if i in last_token_at:
                    itl.append(now - last_token_at[i])
                else:
                    ttft.append(now - added_at[i])
                last_token_at[i] = now
    seconds = time.perf_counter() - start
    stats = engine.stats()
    return Run(config.preemption, seconds, sum(map(len, outputs)), stats.num_preemptions,
               stats.num_swap_preemptions, itl, ttft, outputs)


def peak_tokens(requests) -> int:
    return sum(len(r.prompt) + r.max_tokens for r in requests)


def summarise(runs: list[Run]) -> dict[str, dict[str, float]]:
    table = {}
    for policy in POLICIES:
        mine = [r for r in runs if r.policy == policy]
        if not mine:
            continue
        table[policy] = {
            "tokens_per_s": statistics.median(r.tokens_per_s for r in mine),
            "itl_p50_ms": statistics.median(r.itl(50) for r in mine) * 1000,
            "itl_p99_ms": statistics.median(r.itl(99) for r in mine) * 1000,
            "ttft_p50_s": statistics.median(percentile(r.ttft_s, 50) for r in mine),
            "preemptions": statistics.median(r.preemptions for r in mine),
            "swap_preemptions": statistics.median(r.swap_preemptions for r in mine),
            "seconds": statistics.median(r.seconds for r in mine),
        }
    return table


def print_report(table, runs: list[Run], args, num_blocks: int, peak: int) -> None:
    print(f"{args.num_requests} chat-mix requests, pool {num_blocks} blocks x {args.block_size} = "
          f"{num_blocks * args.block_size:,} tokens for a peak of {peak:,} "
          f"({args.kv_fraction:.0%}); {args.rounds} round(s); medians")
    print(f"{'policy':>10} {'tok/s':>7} {'ITL p50':>9} {'ITL p99':>9} {'TTFT p50':>9} "
          f"{'preempt':>8} {'swapped':>8}")
    for policy, row in table.items():
        print(f"{policy:>10} {row['tokens_per_s']:>7.2f} {row['itl_p50_ms']:>7.0f}ms "
              f"{row['itl_p99_ms']:>7.0f}ms {row['ttft_p50_s']:>8.1f}s {row['preemptions']:>8.0f} "
              f"{row['swap_preemptions']:>8.0f}")
    for policy, row in table.items():
        if policy != "recompute" and "recompute" in table:
            base = table["recompute"]
            print(f"{policy} / recompute: throughput {row['tokens_per_s'] / base['tokens_per_s']:.2f}x, "
                  f"ITL p99 {row['itl_p99_ms'] / base['itl_p99_ms']:.2f}x")
    if "auto" in table:
        others = [table[p] for p in ("swap", "recompute") if p in table]
        best_tps = max(o["tokens_per_s"] for o in others)
        best_p99 = min(o["itl_p99_ms"] for o in others)
        print(f"auto vs the better of swap and recompute: throughput "
              f"{table['auto']['tokens_per_s'] / best_tps:.3f}x, ITL p99 "
              f"{table['auto']['itl_p99_ms'] / best_p99:.3f}x (<= 1 is better)")
    reference = runs[0].outputs
    same = all(r.outputs == reference for r in runs)
    print(f"outputs identical across every policy and round: {same}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--workload", default=WORKLOAD)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens-cap", type=int, default=160,
                   help="cap each request's max_tokens (keeps a CPU run short)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply trace arrival times")
    p.add_argument("--kv-fraction", type=float, default=0.3,
                   help="pool size as a fraction of the tokens the requests reach at their peak")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3, help="each policy once per round")
    p.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    model = load_model(path, torch.float32)
    requests = load_requests(args.workload, args.num_requests, tokenizer)
    for r in requests:
        r.max_tokens = min(r.max_tokens, args.max_tokens_cap)
    with open(args.workload) as f:
        arrivals = [json.loads(line)["t"] * args.time_scale for line, _ in zip(f, requests)]
    peak = peak_tokens(requests)
    num_blocks = max(int(peak * args.kv_fraction) // args.block_size,
                     max(-(-(len(r.prompt) + r.max_tokens) // args.block_size) for r in requests))
    runs: list[Run] = []
    for round_index in range(args.rounds):
        for policy in args.policies:
            config = EngineConfig(device="cpu", dtype="float32", block_size=args.block_size,
                                  num_blocks=num_blocks, max_batched_tokens=args.max_batched_tokens,
                                  preemption=policy)
            run = run_policy(model, requests, arrivals, config)
            runs.append(run)
            print(f"round {round_index + 1} {policy}: {run.tokens_per_s:.2f} tok/s, ITL p99 "
                  f"{run.itl(99) * 1000:.0f} ms, {run.preemptions} preemptions "
                  f"({run.swap_preemptions} swapped)", file=sys.stderr)
            gc.collect()
    table = summarise(runs)
    print_report(table, runs, args, num_blocks, peak)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    if args.json:
        args.json.write_text(json.dumps({"summary": table, "runs": [
            {k: v for k, v in asdict(r).items() if k != "outputs"} for r in runs]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
