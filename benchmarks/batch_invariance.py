"""Batch-invariant numerics (`--deterministic`, issue 35): whether the default model's greedy
answers stay the same whatever happens around them, and what it costs.

1. **Identity.** The chat-mix requests (greedy, each its own max_tokens) run at `--dtype` with
   `--deterministic` on (and, for contrast, off) under every condition: batch sizes 1, 8 and 64
   (`max_running`), prefill chunks of 64 and 512 tokens (`max_batched_tokens`), prefix cache off
   (every prompt computed) and warm (the same requests again in the same engine: the shared
   openings are cache hits), and resumed (each request restarted from half its answer as prompt +
   tokens sent, what a worker does after another died). Reported: requests whose answer equals
   the batch-64 run's, per condition.
2. **Cost.** Throughput on the same requests, on and off alternated `--rounds` times in one
   process (median tok/s and the median of the rounds' ratios); and the prefill of long prompts
   (`--long-prompts` x `--long-tokens` tokens, one output token each), where the prefill kernel
   that `--no-deterministic` keeps is fastest.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 .venv/bin/python -m benchmarks.batch_invariance
    .venv/bin/python -m benchmarks.batch_invariance --num-requests 8 --rounds 1   # quick
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from benchmarks.engine_throughput import WORKLOAD, greedy, load_requests, openmp_wait
from kvfleet.shared.cpu_features import cpu_features
from kvfleet.shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from kvfleet.worker.engine.engine import Engine, EngineConfig
from kvfleet.worker.engine.model.model_prep import load_pretrained

CONDITIONS = {  # name -> EngineConfig fields (and how the run is made)
    "batch 64": {"max_running": 64},
    "batch 8": {"max_running": 8},
    "batch 1": {"max_running": 1},
    "chunks of 64": {"max_batched_tokens": 64},
    "chunks of 512": {"max_batched_tokens": 512},
    "prefix cache off": {"enable_prefix_caching": False},
    "prefix cache warm": {},  # the requests twice in one engine: the second run's answers
    "resumed at half": {},  # prompt + the first half of the batch-64 answer, the rest generated
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default=WORKLOAD)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--modes", default="on,off", help="--deterministic on, off, or both")
    p.add_argument("--conditions", default=",".join(CONDITIONS))
    p.add_argument("--rounds", type=int, default=3, help="throughput rounds, on and off alternated")
    p.add_argument("--long-prompts", type=int, default=4)
    p.add_argument("--long-tokens", type=int, default=2000)
    return p.parse_args(argv)


def make_engine(model, dtype: str, deterministic: bool, **fields) -> Engine:
    return Engine(model, EngineConfig(device="cpu", dtype=dtype, deterministic=deterministic,
                                      **fields))


def answers(engine: Engine, requests, resume: list[list[int]] | None = None) -> list[list[int]]:
    """Each request's whole answer; `resume`: each continues after these tokens."""
    ids = []
    for i, r in enumerate(requests):
        ids.append(f"q{time.monotonic_ns()}-{i}")
        engine.add_request(ids[-1], r.prompt, greedy(r.max_tokens),
                           output_token_ids=None if resume is None else resume[i])
    got: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.req_id].extend(out.new_token_ids)
    return [(resume[i] if resume else []) + got[rid] for i, rid in enumerate(ids)]


def identity(model, requests, dtype: str, deterministic: bool, conditions: list[str]) -> None:
    reference = None
    for name in conditions:
        engine = make_engine(model, dtype, deterministic, **CONDITIONS[name])
        if name == "prefix cache warm":
            answers(engine, requests)
        resume = None
        if name == "resumed at half":
            resume = [ref[:len(ref) // 2] for ref in reference]
        started = time.perf_counter()
        got = answers(engine, requests, resume)
        seconds = time.perf_counter() - started
        stats = engine.stats()
        if reference is None:
            reference = got
        same = sum(a == b for a, b in zip(got, reference))
        first = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
                 for a, b in zip(got, reference)]
        diverged = sorted(f for f in first if f is not None)
        print(f"  {name:18s} {same:3d}/{len(requests)} identical to batch 64"
              f"{f' (first differences at tokens {diverged[:6]})' if diverged else ''}; "
              f"prefix hits {stats.prefix_hit_tokens}/{stats.prefix_queried_tokens} tokens; "
              f"{seconds:.1f} s", flush=True)


def throughput(model, requests, dtype: str, modes: list[bool], rounds: int) -> None:
    tokens = sum(r.max_tokens for r in requests)
    rates: dict[bool, list[float]] = {m: [] for m in modes}
    for round_ in range(rounds):
        for mode in modes if round_ % 2 == 0 else modes[::-1]:
            engine = make_engine(model, dtype, mode)
            started = time.perf_counter()
            answers(engine, requests)
            rates[mode].append(tokens / (time.perf_counter() - started))
            print(f"  round {round_ + 1}, deterministic {'on' if mode else 'off'}: "
                  f"{rates[mode][-1]:.1f} tok/s", flush=True)
    for mode in modes:
        print(f"  deterministic {'on' if mode else 'off'}: median "
              f"{statistics.median(rates[mode]):.1f} tok/s", flush=True)
    if len(modes) == 2:
        ratios = [a / b for a, b in zip(rates[True], rates[False])]
        print(f"  on / off: median of the rounds' ratios {statistics.median(ratios):.3f} "
              f"({', '.join(f'{r:.3f}' for r in ratios)})", flush=True)


def long_prefill(model, dtype: str, modes: list[bool], num: int, length: int, vocab: int) -> None:
    rng = random.Random(0)
    for mode in modes:
        engine = make_engine(model, dtype, mode, enable_prefix_caching=False)
        times = []
        for _ in range(3):
            prompts = [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(num)]
            started = time.perf_counter()
            engine.generate(prompts, greedy(1))
            times.append(time.perf_counter() - started)
        print(f"  deterministic {'on' if mode else 'off'}: {num} prompts x {length} tokens "
              f"prefilled in {statistics.median(times):.2f} s (median of 3)", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    path = resolve_model_path(DEFAULT_MODEL)
    tokenizer = load_tokenizer(path)
    requests = load_requests(args.workload, args.num_requests, tokenizer)
    model = load_pretrained(path, args.dtype, "cpu")
    modes = [{"on": True, "off": False}[m] for m in args.modes.split(",")]
    print(f"# CPU {cpu_features().describe()}; {torch.get_num_threads()} torch threads, torch "
          f"{torch.__version__}; --dtype {args.dtype} = {next(model.parameters()).dtype}; "
          f"{len(requests)} requests, {sum(len(r.prompt) for r in requests)} prompt tokens, "
          f"{sum(r.max_tokens for r in requests)} output tokens; OpenMP wait: {openmp_wait()}; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"# engine: {make_engine(model, args.dtype, modes[0]).device_report()}", flush=True)
    conditions = [c for c in args.conditions.split(",") if c]
    for mode in modes:
        print(f"\nidentity, --deterministic {'on' if mode else 'off'}:", flush=True)
        identity(model, requests, args.dtype, mode, conditions)
    if args.rounds:
        print("\nthroughput, alternated:", flush=True)
        throughput(model, requests, args.dtype, modes, args.rounds)
    if args.long_prompts:
        print("\nlong prompts:", flush=True)
        long_prefill(model, args.dtype, modes, args.long_prompts, args.long_tokens,
                     model.config.vocab_size)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
