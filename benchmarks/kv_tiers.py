"""What the host tier of the prefix cache (`--kv-offloading-size`) buys one worker's engine
(issue 52, case a): a working set of tenant prefixes four times the KV pool, offload on vs off in
the same run, alternated.

T tenants (default 8) each have a system prompt of L random tokens (default 1,024); every request
is one tenant's prefix and its own question (default 16 tokens), greedy, max_tokens 8. Requests
come tenant after tenant, round-robin, `--concurrency` in flight (a closed loop: one enters as one
leaves; default 1, since at 4x a pool of 8 tenants' prefixes holds two requests, and a second in
flight would only wait for room, its TTFT the other's service time), so with the pool holding a quarter of the prefixes, least-recently-used eviction has
always just dropped the prefix the next request needs: without the tier it recomputes it, with
the tier it gets it back from host memory. The first pass over the tenants (both sides cold) is
warm-up, not measured. The pool is sized from the working set (`num_blocks`); the tier holds the
whole working set. Reported per side: TTFT p50/p90 (add_request to the step that returns the
first token), output tokens/s and requests/s over the measured requests, prompt tokens computed,
hits by tier; then the ratios (TTFT p90 off/on, throughput on/off), medians over `--repeats`
alternated pairs, and whether the answers are identical on and off.

Then the issue's per-hit target: one 2,000-token prefix (`--long-prefix-tokens`) served, pushed
out of a pool that holds one request by another prefix, and asked for again: that request's TTFT
with the tier (its blocks brought back) against without (recomputed), medians over the repeats;
then, as many runs after those, the same from the disk tier (`--kv-offloading-disk`: a host tier
of four blocks drops the prefix to a file in a temporary directory, from which the ask takes it
back; the file's pages may still be in the OS's page cache, so this times the tier's own path,
not the disk device).

Each part can be skipped (`--skip-working-set`, `--skip-long-prefix`, `--skip-peer`,
`--skip-shared`); each prints the command that runs it alone. The parts that live elsewhere: the
same long prefix fetched from a peer, in benchmarks/kv_peer_fetch.py; case (c), concurrent
requests sharing a prefix in the tier, in benchmarks/kv_shared_prefix.py; with `--soak-minutes M`
(default 0: none), a soak under case (a), in benchmarks/kv_soak.py; what the parts share (the
model, a batch of requests run to completion, the verdicts), in benchmarks/kv_tiers_common.py.

    .venv/bin/python -m benchmarks.kv_tiers                     # the default run
    .venv/bin/python -m benchmarks.kv_tiers --tenants 4 --prefix-tokens 256 --passes 2  # quick
    .venv/bin/python -m benchmarks.kv_tiers --skip-working-set --skip-long-prefix --skip-shared
    .venv/bin/python -m benchmarks.kv_tiers --skip-working-set --skip-long-prefix --skip-peer \
        --skip-shared --soak-minutes 30                         # the soak alone
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from benchmarks.engine_throughput import greedy
from benchmarks.kv_peer_fetch import peer_part
from benchmarks.kv_shared_prefix import shared_part
from benchmarks.kv_soak import soak_part
from benchmarks.kv_tiers_common import Setup, verdict, working_set_pool
from benchmarks.prefix_cache import percentile, random_tokens
from kvfleet.shared.models import DEFAULT_MODEL
from kvfleet.worker.engine.engine import Engine, EngineConfig


@dataclass
class Side:
    """One run of the workload through a fresh engine, the tier on or off."""

    label: str
    seconds: float = 0.0  # of the measured requests: from the first one's add to the last's end
    output_tokens: int = 0
    requests: int = 0
    ttft_s: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)  # every request's, in order
    stats: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    def line(self) -> str:
        s = self.stats
        return (f"  {self.label:>3}: TTFT p50 {percentile(self.ttft_s, 50) * 1000:7.1f} ms, p90 "
                f"{percentile(self.ttft_s, 90) * 1000:7.1f} ms; {self.tokens_per_s:6.1f} output "
                f"tok/s, {self.requests_per_s:5.2f} req/s; prompt tokens computed "
                f"{s['num_prefill_tokens_computed']:,}; hits device "
                f"{s['prefix_hit_tokens'] - s['prefix_host_hit_tokens']:,} host "
                f"{s['prefix_host_hit_tokens']:,} of {s['prefix_queried_tokens']:,}; offloaded "
                f"{s['kv_offloaded_blocks']} blocks, restored {s['kv_offload_restored_blocks']}")


def workload(args, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [random_tokens(rng, args.prefix_tokens, vocab_size) for _ in range(args.tenants)]
    return [prefixes[i % args.tenants] + random_tokens(rng, args.question_tokens, vocab_size)
            for i in range(args.tenants * args.passes)]


def drive(model, config: EngineConfig, label: str, prompts: list[list[int]], args) -> Side:
    """A closed loop of `concurrency` requests; the first `tenants` are warm-up."""
    engine = Engine(copy.deepcopy(model), config)
    side = Side(label, outputs=[[] for _ in prompts])
    added: dict[str, tuple[int, float]] = {}
    first_token: dict[int, float] = {}
    next_index, start = 0, None
    while next_index < len(prompts) or engine.has_unfinished():
        while next_index < len(prompts) and len(added) < args.concurrency:
            if next_index == args.tenants:  # the measured part starts with its first request
                start = time.perf_counter()
            req_id = f"{label}-{next_index}"
            engine.add_request(req_id, prompts[next_index], greedy(args.max_tokens))
            added[req_id] = (next_index, time.perf_counter())
            next_index += 1
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.error:
                raise RuntimeError(f"{out.req_id} failed: {out.error}")
            index, at = added[out.req_id]
            if out.new_token_ids and index not in first_token:
                first_token[index] = now - at
            side.outputs[index].extend(out.new_token_ids)
            if out.finish_reason is not None:
                del added[out.req_id]
    side.seconds = time.perf_counter() - start
    measured = range(args.tenants, len(prompts))
    side.ttft_s = [first_token[i] for i in measured]
    side.output_tokens = sum(len(side.outputs[i]) for i in measured)
    side.requests = len(measured)
    assert all(len(o) == args.max_tokens for o in side.outputs), "a request stopped short"
    side.stats = vars(engine.stats())
    del engine
    gc.collect()
    return side


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--question-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--passes", type=int, default=3, help="passes over the tenants (first: warm-up)")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--working-set-ratio", type=float, default=4.0,
                   help="the tenants' prefixes over the pool's tokens")
    p.add_argument("--repeats", type=int, default=2,
                   help="alternated pairs (on/off, device/host); the peer part's repeats")
    p.add_argument("--long-prefix-tokens", type=int, default=2000,
                   help="the per-hit and peer parts' prefix (0: skip both)")
    p.add_argument("--shared-prefix-tokens", type=int, default=10000,
                   help="case (c)'s shared prefix (capped to the model's context less the "
                        "question and max_tokens)")
    p.add_argument("--shared-requests", type=int, default=50,
                   help="case (c)'s concurrent requests sharing it")
    p.add_argument("--skip-working-set", action="store_true", help="skip case (a)'s working set")
    p.add_argument("--skip-long-prefix", action="store_true",
                   help="skip the long prefix from the tier vs recomputed")
    p.add_argument("--skip-peer", action="store_true",
                   help="skip the long prefix fetched from a peer vs recomputed")
    p.add_argument("--skip-shared", action="store_true",
                   help="skip case (c): concurrent requests sharing a prefix in the tier")
    p.add_argument("--soak-minutes", type=float, default=0.0,
                   help="after the other parts, case (a)'s workload with the tier on for this "
                        "long (fractions allowed; 0: no soak)")
    p.add_argument("--soak-sample-s", type=float, default=30.0,
                   help="the soak's seconds between two samples")
    p.add_argument("--soak-tier-fraction", type=float, default=0.5,
                   help="the soak's host tier over the working set (below 1: the tier evicts)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    if args.soak_minutes < 0:
        p.error("--soak-minutes must be 0 (no soak) or more")
    if args.soak_sample_s <= 0:
        p.error("--soak-sample-s must be more than 0")
    if args.soak_tier_fraction <= 0:
        p.error("--soak-tier-fraction must be more than 0")
    return args


# the flags each part reads (beside --model, --dtype, --threads, --repeats, --seed)
PART_FLAGS = {
    "working_set": ("tenants", "prefix_tokens", "question_tokens", "max_tokens", "passes",
                    "concurrency", "working_set_ratio"),
    "long_prefix": ("long_prefix_tokens", "question_tokens", "max_tokens"),
    "peer": ("long_prefix_tokens", "question_tokens", "max_tokens"),
    "shared": ("shared_prefix_tokens", "shared_requests", "question_tokens", "max_tokens"),
}
# the soak's (not skipped but asked for: --soak-minutes; beside --model, --dtype, --threads, --seed)
SOAK_FLAGS = ("tenants", "prefix_tokens", "question_tokens", "max_tokens", "concurrency",
              "working_set_ratio", "soak_minutes", "soak_sample_s", "soak_tier_fraction")


def part_command(args: argparse.Namespace, part: str) -> str:
    """The command line that runs `part` (one of PART_FLAGS, or "soak") alone with these
    figures."""
    words = [".venv/bin/python", "-m", "benchmarks.kv_tiers"]
    for name, default in (("model", DEFAULT_MODEL), ("dtype", "auto"), ("threads", None)):
        if getattr(args, name) != default:
            words += [f"--{name}", str(getattr(args, name))]
    flags = SOAK_FLAGS if part == "soak" else (*PART_FLAGS[part], "repeats")
    for name in (*flags, "seed"):
        words += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    words += ["--skip-" + other.replace("_", "-") for other in PART_FLAGS if other != part]
    return shlex.join(words)


def alternated(args, setup: Setup, base: dict, tier_gib: float, prompts: list[list[int]],
               loop) -> dict[str, list[Side]]:
    sides: dict[str, list[Side]] = {"on": [], "off": []}
    for repeat in range(args.repeats):
        for label in (("off", "on") if repeat % 2 == 0 else ("on", "off")):
            size = tier_gib if label == "on" else 0.0
            side = drive(setup.model, EngineConfig(**base, kv_offloading_size=size), label,
                         prompts, loop)
            sides[label].append(side)
            print(side.line(), flush=True)
    return sides


def working_set_part(args, setup: Setup) -> dict:
    working_set, num_blocks = working_set_pool(args, setup)
    tier_gib = 1.25 * setup.gib(working_set // setup.block_size + args.tenants)
    prompts = workload(args, setup.vocab_size)
    print(f"\n## (a) {args.tenants} tenants x {args.prefix_tokens}-token prefix = "
          f"{working_set:,} tokens, pool {num_blocks * setup.block_size:,} tokens "
          f"({working_set / (num_blocks * setup.block_size):.1f}x), tier {tier_gib:.3f} GiB; "
          f"{len(prompts) - args.tenants} measured requests (+{args.tenants} warm-up), "
          f"concurrency {args.concurrency}, max_tokens {args.max_tokens}\n"
          f"{part_command(args, 'working_set')}", flush=True)
    base = dict(device="cpu", dtype=args.dtype, num_blocks=num_blocks,
                max_running=args.concurrency)
    sides = alternated(args, setup, base, tier_gib, prompts, args)
    median = {label: {"ttft_p90_s": statistics.median(percentile(s.ttft_s, 90) for s in runs),
                      "ttft_p50_s": statistics.median(percentile(s.ttft_s, 50) for s in runs),
                      "tokens_per_s": statistics.median(s.tokens_per_s for s in runs),
                      "requests_per_s": statistics.median(s.requests_per_s for s in runs)}
              for label, runs in sides.items()}
    on, off = median["on"], median["off"]
    ttft_ratio = off["ttft_p90_s"] / on["ttft_p90_s"]
    throughput_ratio = on["tokens_per_s"] / off["tokens_per_s"]
    identical = all(a.outputs == b.outputs for a in sides["on"] for b in sides["off"])
    print("\n| medians | TTFT p50 | TTFT p90 | output tok/s | req/s |\n|---|---|---|---|---|")
    for label in ("off", "on"):
        m = median[label]
        print(f"| tier {label} | {m['ttft_p50_s'] * 1000:.1f} ms | {m['ttft_p90_s'] * 1000:.1f} ms "
              f"| {m['tokens_per_s']:.1f} | {m['requests_per_s']:.2f} |")
    print(f"\nRATIO TTFT p90 off/on = {ttft_ratio:.1f}x (target >= 5x) -> "
          f"{'MET' if ttft_ratio >= 5 else 'MISSED'}")
    print(f"RATIO throughput on/off = {throughput_ratio:.2f}x (target >= 2x) -> "
          f"{'MET' if throughput_ratio >= 2 else 'MISSED'}")
    print(f"answers identical on and off: {identical}", flush=True)
    return {"command": part_command(args, "working_set"), "median": median,
            "ttft_p90_ratio": ttft_ratio, "throughput_ratio": throughput_ratio,
            "identical": identical,
            "runs": {k: [{"ttft_s": s.ttft_s, "seconds": s.seconds, **s.stats} for s in v]
                     for k, v in sides.items()}}


def long_prefix_part(args, setup: Setup) -> dict:
    rng = random.Random(args.seed + 1)
    long, other = (random_tokens(rng, args.long_prefix_tokens, setup.vocab_size)
                   for _ in range(2))
    prompts = [prefix + random_tokens(rng, args.question_tokens, setup.vocab_size)
               for prefix in (long, other, long)]
    # exactly one request: the other prefix's request evicts every block of the first
    num_blocks = setup.blocks(args.long_prefix_tokens + args.question_tokens + args.max_tokens)
    print(f"\n## one {args.long_prefix_tokens:,}-token prefix pushed out of a pool that holds one "
          f"request ({num_blocks} blocks) and asked for again: its TTFT\n"
          f"{part_command(args, 'long_prefix')}", flush=True)
    loop = argparse.Namespace(tenants=2, concurrency=1, max_tokens=args.max_tokens)
    base = dict(device="cpu", dtype=args.dtype, num_blocks=num_blocks, max_running=1)
    sides = alternated(args, setup, base, 1.25 * setup.gib(2 * num_blocks), prompts, loop)
    ttft = {label: statistics.median(s.ttft_s[0] for s in runs) for label, runs in sides.items()}
    ratio = ttft["off"] / ttft["on"]
    print(f"RATIO {args.long_prefix_tokens:,}-token prefix from the tier vs recomputed: TTFT "
          f"{ttft['on'] * 1000:.1f} vs {ttft['off'] * 1000:.1f} ms = {ratio:.1f}x "
          f"(target >= 5x) -> {'MET' if ratio >= 5 else 'MISSED'}", flush=True)
    # the disk tier (--kv-offloading-disk): a host tier of 4 blocks drops the prefix to a file,
    # from which the ask takes it back; as many runs as each side above, after them
    with tempfile.TemporaryDirectory(prefix="kv-disk-") as directory:
        disk_config = EngineConfig(**base, kv_offloading_size=setup.gib(4),
                                   kv_offloading_disk=directory,
                                   kv_offloading_disk_size=1.25 * setup.gib(2 * num_blocks))
        disk = [drive(setup.model, disk_config, "disk", prompts, loop)
                for _ in range(args.repeats)]
    for side in disk:
        print(f"{side.line()}; of them from disk {side.stats['prefix_disk_hit_tokens']:,}",
              flush=True)
    ttft["disk"] = statistics.median(s.ttft_s[0] for s in disk)
    disk_ratio = ttft["off"] / ttft["disk"]
    identical = all(s.outputs == disk[0].outputs for runs in sides.values() for s in runs)
    print(f"RATIO {args.long_prefix_tokens:,}-token prefix from the disk tier vs recomputed: TTFT "
          f"{ttft['disk'] * 1000:.1f} vs {ttft['off'] * 1000:.1f} ms = {disk_ratio:.1f}x "
          f"(target >= 5x) -> {'MET' if disk_ratio >= 5 else 'MISSED'}; answers identical "
          f"with the tier off, on and on disk: {identical}", flush=True)
    return {"command": part_command(args, "long_prefix"), "ttft_s": ttft, "ratio": ratio,
            "disk_ratio": disk_ratio, "identical": identical,
            "disk_hit_tokens": [s.stats["prefix_disk_hit_tokens"] for s in disk],
            "target": 5.0, "verdict": verdict(ratio, 5)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    setup = Setup(args)
    print(f"# kv_tiers: {args.model}, {str(setup.dtype).removeprefix('torch.')}, block size "
          f"{setup.block_size}; {args.repeats} alternated pairs; "
          f"{torch.get_num_threads()} torch threads on {platform.processor() or platform.machine()}",
          flush=True)
    results = {"args": vars(args)}
    if not args.skip_working_set:
        results["working_set"] = working_set_part(args, setup)
    if args.long_prefix_tokens and not args.skip_long_prefix:
        results["long_prefix"] = long_prefix_part(args, setup)
    if args.long_prefix_tokens and not args.skip_peer:
        results["peer"] = peer_part(args, setup, part_command(args, "peer"))
    if args.shared_requests and not args.skip_shared:
        results["shared"] = shared_part(args, setup, part_command(args, "shared"))
    if args.soak_minutes > 0:
        results["soak"] = soak_part(args, setup, part_command(args, "soak"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    passed = [results["working_set"]["identical"] if "working_set" in results else True,
            results["peer"]["answers_match"] if "peer" in results else True,
            results["shared"]["identical"] if "shared" in results else True,
            results["soak"]["ok"] if "soak" in results else True]
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())
