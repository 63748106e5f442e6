"""What automatic prefix caching buys (and costs) kvfleet's engine, cache on vs off in one run.

Part 1, shared opening: N requests (default 100) share an opening of L random tokens (default
1,024) and each has its own random ending (default 32 tokens); all arrive at t=0, each asks for a
short greedy answer (max_tokens 8, ignore_eos). Reported per side: prefill tokens actually
computed (EngineStats), TTFT p50/p99 (wall time from add_request to the return of the step that
emits the request's first token, measured in a driver loop around `engine.step()`), total time,
and whether the outputs are identical on vs off. `--seed-scale` runs the design seed's 1,000 x
2,000.
Part 2, chat-mix: the first M requests of benchmarks/data/chat-mix-64.jsonl, chat-templated
(about 40% share one of three openings): hit rate and output throughput on vs off.
Part 3, 0% hits: distinct random prompts, on vs off alternated, to show what the cache costs when
it never hits.

    .venv/bin/python -m benchmarks.prefix_cache                          # the default run
    .venv/bin/python -m benchmarks.prefix_cache --num-requests 20 --chat-mix-requests 16  # quick
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks.engine_throughput import WORKLOAD, greedy, load_model, load_requests
from kvfleet.shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from kvfleet.worker.engine.engine import Engine, EngineConfig


@dataclass
class Run:
    """One pass of a workload through a fresh engine."""

    label: str
    seconds: float
    output_tokens: int
    prefill_tokens_computed: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    ttft_s: list[float] = field(default_factory=list)  # per request, in request order
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    def summary(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("ttft_s", "outputs")}
        d.update(tokens_per_s=self.tokens_per_s, hit_rate=self.hit_rate)
        if self.ttft_s:
            d.update(ttft_p50_s=percentile(self.ttft_s, 50), ttft_p99_s=percentile(self.ttft_s, 99))
        return d


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile (p99 of 100 values is the 99th smallest)."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * pct // 100))
    return ordered[int(rank) - 1]


def drive(model, config: EngineConfig, label: str, prompts: list[list[int]],
          max_tokens: list[int]) -> Run:
    """All prompts arrive at once; step until done, timing each request's first token."""
    engine = Engine(copy.deepcopy(model), config)
    seconds, ttft, outputs = run_at_once(engine, label, prompts, max_tokens)
    stats = engine.stats()
    del engine
    gc.collect()
    return Run(label, seconds, sum(map(len, outputs)), stats.num_prefill_tokens_computed,
               stats.prefix_queried_tokens, stats.prefix_hit_tokens, stats.num_preemptions,
               [t for t in ttft if t is not None], outputs)


def run_at_once(engine: Engine, label: str, prompts: list[list[int]], max_tokens: list[int]
                ) -> tuple[float, list[float | None], list[list[int]]]:
    """`prompts` added at once (greedy, `max_tokens[i]` each) and stepped until every one ends:
    seconds from the first add to the last step, each request's add to the step that returned
    its first token (None: none came), and its tokens. A failed or short request raises."""
    req_ids = [f"{label}-{i}" for i in range(len(prompts))]
    index = {r: i for i, r in enumerate(req_ids)}
    added_at = []
    start = time.perf_counter()
    for req_id, prompt, n in zip(req_ids, prompts, max_tokens):
        engine.add_request(req_id, prompt, greedy(n))
        added_at.append(time.perf_counter())
    ttft: list[float | None] = [None] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    while engine.has_unfinished():
        step_outputs = engine.step()
        now = time.perf_counter()
        for out in step_outputs:
            if out.error:
                raise RuntimeError(f"{out.req_id} failed: {out.error}")
            i = index[out.req_id]
            if out.new_token_ids and ttft[i] is None:
                ttft[i] = now - added_at[i]
            outputs[i].extend(out.new_token_ids)
    seconds = time.perf_counter() - start
    if [len(o) for o in outputs] != list(max_tokens):
        raise RuntimeError("a request stopped short")
    return seconds, ttft, outputs


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    # skip the low ids, where SmolLM's special tokens live
    return [rng.randrange(256, vocab_size) for _ in range(n)]


def identical(a: Run, b: Run) -> int:
    return sum(x == y for x, y in zip(a.outputs, b.outputs))


def engine_config(args, caching: bool) -> EngineConfig:
    return EngineConfig(device="cpu", dtype="float32", enable_prefix_caching=caching,
                        block_size=args.block_size,
                        kv_memory_bytes=int(args.kv_memory_gib * (1 << 30)),
                        max_batched_tokens=args.max_batched_tokens, max_running=args.max_running)


# ---- the three parts ----------------------------------------------------------------------------


def shared_opening_part(args, model, vocab_size: int) -> dict:
    n, opening, ending = args.num_requests, args.opening_tokens, args.ending_tokens
    rng = random.Random(args.seed)
    head = random_tokens(rng, opening, vocab_size)
    prompts = [head + random_tokens(rng, ending, vocab_size) for _ in range(n)]
    max_tokens = [args.max_tokens] * n
    print(f"\n## shared opening: {n} requests x ({opening} shared + {ending} own) tokens, "
          f"max_tokens {args.max_tokens}", flush=True)
    runs = {}
    for caching in (True, False):
        label = "on" if caching else "off"
        runs[label] = run = drive(model, engine_config(args, caching), label, prompts, max_tokens)
        print(f"  cache {label}: prefill computed {run.prefill_tokens_computed:,} tokens, hit "
              f"{run.prefix_hit_tokens:,}/{run.prefix_queried_tokens:,}, TTFT p50 "
              f"{percentile(run.ttft_s, 50):.2f} s p99 {percentile(run.ttft_s, 99):.2f} s, total "
              f"{run.seconds:.1f} s, preemptions {run.num_preemptions}", flush=True)
    on, off = runs["on"], runs["off"]
    ratio = on.prefill_tokens_computed / off.prefill_tokens_computed
    bound = (opening + n * ending) / (n * (opening + ending))
    bound_slack = (opening + n * (ending + args.block_size)) / (n * (opening + ending))
    speedup = percentile(off.ttft_s, 50) / percentile(on.ttft_s, 50)
    speedup_p99 = percentile(off.ttft_s, 99) / percentile(on.ttft_s, 99)
    same = identical(on, off)
    print(f"RATIO computed prefill on/off = {ratio:.4f}; bound (L + N*e)/(N*(L+e)) = {bound:.4f}, "
          f"with one block per request {bound_slack:.4f} -> {'MET' if ratio <= bound_slack else 'MISSED'}")
    print(f"RATIO TTFT p50 speed-up = {speedup:.1f}x (target >= 5x) -> "
          f"{'MET' if speedup >= 5 else 'MISSED'}; p99 {speedup_p99:.1f}x; "
          f"total time {off.seconds / on.seconds:.1f}x")
    print(f"outputs identical on vs off: {same}/{n} requests")
    return {"on": on.summary(), "off": off.summary(), "computed_prefill_ratio": ratio,
            "bound": bound, "bound_with_one_block_per_request": bound_slack,
            "ttft_p50_speedup": speedup, "identical_outputs": same, "requests": n}


def chat_mix_part(args, model, tokenizer) -> dict:
    requests = load_requests(args.workload, args.chat_mix_requests, tokenizer)
    prompts = [r.prompt for r in requests]
    max_tokens = [min(r.max_tokens, args.chat_mix_max_tokens or r.max_tokens) for r in requests]
    print(f"\n## chat-mix: {len(requests)} requests, {sum(map(len, prompts)):,} prompt tokens, "
          f"{sum(max_tokens):,} output tokens", flush=True)
    runs = {}
    for caching in (True, False):
        label = "on" if caching else "off"
        runs[label] = run = drive(model, engine_config(args, caching), f"chat-{label}", prompts, max_tokens)
        print(f"  cache {label}: hit rate {run.hit_rate:.1%} ({run.prefix_hit_tokens:,}/"
              f"{run.prefix_queried_tokens:,}), prefill computed {run.prefill_tokens_computed:,}, "
              f"{run.tokens_per_s:.1f} output tok/s ({run.seconds:.1f} s)", flush=True)
    on, off = runs["on"], runs["off"]
    print(f"RATIO chat-mix output throughput on/off = {on.tokens_per_s / off.tokens_per_s:.2f}x; "
          f"outputs identical: {identical(on, off)}/{len(requests)}")
    return {"on": on.summary(), "off": off.summary(), "throughput_ratio": on.tokens_per_s / off.tokens_per_s,
            "identical_outputs": identical(on, off), "requests": len(requests)}


def zero_hit_part(args, model, vocab_size: int) -> dict:
    rng = random.Random(args.seed + 1)
    prompts = [random_tokens(rng, args.zero_hit_prompt_tokens, vocab_size)
               for _ in range(args.zero_hit_requests)]
    max_tokens = [args.zero_hit_max_tokens] * len(prompts)
    print(f"\n## 0% hits: {len(prompts)} distinct random prompts x {args.zero_hit_prompt_tokens} "
          f"tokens, max_tokens {args.zero_hit_max_tokens}, {args.zero_hit_repeats} alternated "
          f"repeats", flush=True)
    runs: dict[str, list[Run]] = {"on": [], "off": []}
    for i in range(args.zero_hit_repeats):
        order = (True, False) if i % 2 == 0 else (False, True)  # alternate who goes first
        for caching in order:
            label = "on" if caching else "off"
            run = drive(model, engine_config(args, caching), f"zero-{label}-{i}", prompts, max_tokens)
            runs[label].append(run)
            print(f"  cache {label}: {run.tokens_per_s:.2f} output tok/s ({run.seconds:.2f} s), "
                  f"hits {run.prefix_hit_tokens}", flush=True)
    median = {k: statistics.median(r.tokens_per_s for r in v) for k, v in runs.items()}
    ratio = median["on"] / median["off"]
    assert all(r.prefix_hit_tokens == 0 for r in runs["on"]), "the 0%-hit workload hit"
    print(f"RATIO 0%-hit throughput on/off (medians) = {ratio:.3f} (target >= 0.97) -> "
          f"{'MET' if ratio >= 0.97 else 'MISSED'}")
    return {"on_tokens_per_s": [r.tokens_per_s for r in runs["on"]],
            "off_tokens_per_s": [r.tokens_per_s for r in runs["off"]], "median_ratio": ratio}


# ---- main ---------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--workload", default=WORKLOAD)
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--opening-tokens", type=int, default=1024)
    p.add_argument("--ending-tokens", type=int, default=32)
    p.add_argument("--seed-scale", action="store_true",
                   help="the design seed's scale: 1,000 requests x 2,000-token opening")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--chat-mix-requests", type=int, default=64)
    p.add_argument("--chat-mix-max-tokens", type=int, default=0,
                   help="cap each chat-mix request's max_tokens (0 = the workload's own)")
    p.add_argument("--skip-chat-mix", action="store_true")
    p.add_argument("--zero-hit-requests", type=int, default=16)
    p.add_argument("--zero-hit-prompt-tokens", type=int, default=256)
    p.add_argument("--zero-hit-max-tokens", type=int, default=32)
    p.add_argument("--zero-hit-repeats", type=int, default=3)
    p.add_argument("--skip-zero-hit", action="store_true")
    p.add_argument("--kv-memory-gib", type=float, default=6.0,
                   help="KV budget; 100 x 1,064 fp32 tokens need ~4.9 GiB with the cache off")
    p.add_argument("--max-batched-tokens", type=int, default=512,
                   help="keep <= the first prompt: requests admitted in the same step as the first "
                        "cannot hit blocks it has not yet computed")
    p.add_argument("--max-running", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if args.seed_scale:
        args.num_requests, args.opening_tokens = 1000, 2000
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    model = load_model(path, torch.float32)
    vocab_size = model.config.vocab_size
    print(f"# {platform.machine()} {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
          f"float32, kv {args.kv_memory_gib} GiB, max_batched_tokens {args.max_batched_tokens}, "
          f"max_running {args.max_running}; load average {os.getloadavg()[0]:.1f}", flush=True)
    report: dict = {"args": vars(args)}
    report["shared_opening"] = shared_opening_part(args, model, vocab_size)
    if not args.skip_chat_mix:
        report["chat_mix"] = chat_mix_part(args, model, tokenizer)
    if not args.skip_zero_hit:
        report["zero_hit"] = zero_hit_part(args, model, vocab_size)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
