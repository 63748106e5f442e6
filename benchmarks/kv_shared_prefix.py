"""Case (c): `--shared-requests` (50) requests sharing one `--shared-prefix-tokens` (10,000,
capped to the model's context less the question and max_tokens) prefix, each with its own
question, added at once and run to completion, on an engine whose pool holds their own blocks and
one copy of the prefix, the tier on in both sides: "device", the prefix served once and left in
the pool; "host", served once and then pushed into the tier by other prompts (until the pool holds
none of it and the tier all of it; their blocks, evictable, are evicted as the requests need room,
as a busy worker's would be). Target: host throughput at least 0.95x device (one load of the
prefix, not one per request). Sides alternated, medians over `--repeats`.

Runs through `python -m benchmarks.kv_tiers` (alone: `--skip-working-set --skip-long-prefix
--skip-peer`; skipped: `--skip-shared`)."""

from __future__ import annotations

import gc
import math
import random
import statistics
from dataclasses import dataclass

from benchmarks.kv_tiers_common import Setup, fresh, run_batch, verdict
from benchmarks.prefix_cache import percentile, random_tokens
from kvfleet.shared.wire.prefix_hash import BlockHash, block_hashes
from kvfleet.worker.engine.engine import Engine, EngineConfig

SHARED_TARGET = 0.95  # case (c): host-tier throughput at least 0.95x the all-device-hit one


def shared_prefix_length(requested: int, max_model_len: int, question_tokens: int,
                         max_tokens: int) -> tuple[int, bool]:
    """Case (c)'s prefix: `requested` tokens, or fewer where a request (the prefix, its question,
    its answer) would not fit the model's context; and whether it was capped."""
    room = max_model_len - question_tokens - max_tokens
    if room < 1:
        raise ValueError(f"a context of {max_model_len} leaves no room for a prefix beside a "
                         f"{question_tokens}-token question and {max_tokens} output tokens")
    return min(requested, room), requested > room


def shared_pool_blocks(prefix_tokens: int, question_tokens: int, max_tokens: int, requests: int,
                       block_size: int, watermark: float = 0.01) -> int:
    """A pool that holds `requests` requests' own blocks and one copy of their shared prefix's
    full blocks (a partly filled last prefix block is each request's own), beside the share the
    scheduler keeps free (`watermark`) and a block of slack."""
    shared = prefix_tokens // block_size
    own = -(-(prefix_tokens + question_tokens + max_tokens) // block_size) - shared
    needed = shared + requests * own
    return math.ceil(needed / (1 - watermark)) + 1


@dataclass
class SharedSide:
    """The N requests through one engine, their prefix in the pool ("device") or the tier."""

    label: str
    seconds: float
    output_tokens: int
    ttft_s: list[float]
    outputs: list[list[int]]
    pushed_by: int  # prompts served to push the prefix out of the pool
    restored_blocks: int  # host tier blocks copied back during the N requests
    host_hit_tokens: int
    hit_tokens: int
    computed_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def line(self) -> str:
        return (f"  {self.label:>6}: {self.tokens_per_s:6.1f} output tok/s, {self.seconds:.2f} s, "
                f"TTFT p50 {percentile(self.ttft_s, 50) * 1000:7.1f} ms, p90 "
                f"{percentile(self.ttft_s, 90) * 1000:7.1f} ms; prompt tokens computed "
                f"{self.computed_tokens:,}, hits {self.hit_tokens:,} (host "
                f"{self.host_hit_tokens:,}); restored {self.restored_blocks} blocks"
                + (f" (prefix pushed out by {self.pushed_by} prompts)" if self.pushed_by else ""))


def push_out(engine: Engine, label: str, prefix: list[int], hashes: list[BlockHash],
             rng: random.Random, setup: Setup, args) -> int:
    """Serve other prompts of the prefix's length until the pool holds none of the prefix and
    the tier all of it; how many."""
    bm = engine.block_manager
    request_blocks = bm.blocks_for_tokens(len(prefix) + args.question_tokens + 1)
    for pushed in range(2 * -(-bm.num_blocks // request_blocks) + 2):
        if bm.num_cached_leading_blocks(prefix) == 0:
            break
        other = random_tokens(rng, len(prefix) + args.question_tokens, setup.vocab_size)
        run_batch(engine, f"{label}-push{pushed}", [other], 1)
    else:
        raise RuntimeError("the prefix stayed in the pool")
    held = bm.num_held_leading_blocks(hashes)
    if held != len(hashes):
        raise RuntimeError(f"the tier holds {held} of the prefix's {len(hashes)} blocks")
    return pushed


def shared_side(args, setup: Setup, config: EngineConfig, label: str, prefix: list[int],
                questions: list[list[int]], repeat: int) -> SharedSide:
    rng = random.Random(args.seed + 100 + repeat)
    engine = fresh(setup, config)
    # both sides first serve the same two prompts of the prefix's length (the pool's pages
    # touched, the engine's buffers grown) so that neither measures a colder engine: the host
    # side's pushes would otherwise warm it alone
    for i in range(2):
        other = random_tokens(rng, len(prefix) + args.question_tokens, setup.vocab_size)
        run_batch(engine, f"{label}-prewarm{i}", [other], 1)
    warm = random_tokens(rng, args.question_tokens, setup.vocab_size)
    run_batch(engine, f"{label}-warm", [prefix + warm], 1)
    hashes = block_hashes(prefix, setup.block_size, engine.block_manager.root)
    pushed = push_out(engine, label, prefix, hashes, rng, setup, args) if label == "host" else 0
    before = engine.stats()
    done = run_batch(engine, label, [prefix + q for q in questions], args.max_tokens)
    after = engine.stats()
    del engine
    gc.collect()
    return SharedSide(
        label, done.seconds, done.output_tokens, done.ttft_s, done.outputs, pushed,
        after.kv_offload_restored_blocks - before.kv_offload_restored_blocks,
        after.prefix_host_hit_tokens - before.prefix_host_hit_tokens,
        after.prefix_hit_tokens - before.prefix_hit_tokens,
        after.num_prefill_tokens_computed - before.num_prefill_tokens_computed)


def shared_part(args, setup: Setup, command: str) -> dict:
    prefix_tokens, capped = shared_prefix_length(args.shared_prefix_tokens, setup.max_model_len,
                                                 args.question_tokens, args.max_tokens)
    rng = random.Random(args.seed + 3)
    prefix = random_tokens(rng, prefix_tokens, setup.vocab_size)
    questions = [random_tokens(rng, args.question_tokens, setup.vocab_size)
                 for _ in range(args.shared_requests)]
    num_blocks = shared_pool_blocks(prefix_tokens, args.question_tokens, args.max_tokens,
                                    args.shared_requests, setup.block_size)
    # the tier holds what pushing the prefix out and the requests' room evict, the prefix first
    pusher_blocks = setup.blocks(prefix_tokens + args.question_tokens + 1)
    tier_gib = 1.25 * setup.gib(2 * num_blocks + 3 * pusher_blocks)
    config = EngineConfig(device="cpu", dtype=args.dtype, num_blocks=num_blocks,
                          max_running=args.shared_requests, kv_offloading_size=tier_gib)
    cap_note = (f" (capped from {args.shared_prefix_tokens:,}: the model's context is "
                f"{setup.max_model_len:,} tokens)" if capped else "")
    print(f"\n## (c) {args.shared_requests} concurrent requests sharing one {prefix_tokens:,}-token"
          f" prefix{cap_note}, each with its own {args.question_tokens}-token question, max_tokens"
          f" {args.max_tokens}: the prefix in the device pool vs in the host tier; pool "
          f"{num_blocks} blocks ({num_blocks * setup.block_size:,} tokens), tier {tier_gib:.3f} "
          f"GiB\n{command}", flush=True)
    sides: dict[str, list[SharedSide]] = {"device": [], "host": []}
    for repeat in range(args.repeats):
        for label in (("device", "host") if repeat % 2 == 0 else ("host", "device")):
            side = shared_side(args, setup, config, label, prefix, questions, repeat)
            sides[label].append(side)
            print(side.line(), flush=True)
    median = {label: {"tokens_per_s": statistics.median(s.tokens_per_s for s in runs),
                      "seconds": statistics.median(s.seconds for s in runs),
                      "ttft_p50_s": statistics.median(percentile(s.ttft_s, 50) for s in runs),
                      "ttft_p90_s": statistics.median(percentile(s.ttft_s, 90) for s in runs),
                      "restored_blocks": statistics.median(s.restored_blocks for s in runs)}
              for label, runs in sides.items()}
    ratio = median["host"]["tokens_per_s"] / median["device"]["tokens_per_s"]
    identical = all(a.outputs == b.outputs for a in sides["host"] for b in sides["device"])
    print("\n| medians | output tok/s | seconds | TTFT p50 | TTFT p90 | restored blocks |\n"
          "|---|---|---|---|---|---|")
    for label in ("device", "host"):
        m = median[label]
        print(f"| prefix in {label} | {m['tokens_per_s']:.1f} | {m['seconds']:.2f} | "
              f"{m['ttft_p50_s'] * 1000:.1f} ms | {m['ttft_p90_s'] * 1000:.1f} ms | "
              f"{m['restored_blocks']:g} |")
    print(f"\nRATIO throughput host/device = {ratio:.2f}x (target >= {SHARED_TARGET:g}x) -> "
          f"{verdict(ratio, SHARED_TARGET)}")
    print(f"answers identical host and device: {identical}", flush=True)
    return {"prefix_tokens": prefix_tokens, "requested_prefix_tokens": args.shared_prefix_tokens,
            "capped": capped, "max_model_len": setup.max_model_len,
            "requests": args.shared_requests, "num_blocks": num_blocks, "tier_gib": tier_gib,
            "prefix_blocks": prefix_tokens // setup.block_size,
            "command": command, "median": median, "ratio": ratio,
            "target": SHARED_TARGET, "verdict": verdict(ratio, SHARED_TARGET),
            "identical": identical,
            "runs": {label: [{k: v for k, v in vars(s).items() if k != "outputs"} for s in runs]
                     for label, runs in sides.items()}}
