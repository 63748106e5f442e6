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
with the tier (its blocks brought back) against without (recomputed), medians over the repeats.

Then the same prefix fetched from a peer (worker/handoff/peer_prefixes.py; target: a fetch at
least 5x faster than recomputing it): engine A computes it (one request, the prefix and a few
tokens, max_tokens 1); a fresh engine B of the same config fetches its blocks from A over a real
TcpTransferPlane on loopback (export, the wire, decode, install: timed) and then serves the
prefix with a new question (its TTFT); a third fresh engine C serves that prompt computing all of
it. The ratio is C's TTFT over B's fetch + TTFT; B's answer must be C's (greedy). In the product
the holder's loop answers a fetch between two of its steps; here A is idle, so the plane's thread
exports from it directly.

Then case (c): `--shared-requests` (50) requests sharing one `--shared-prefix-tokens` (10,000,
capped to the model's context less the question and max_tokens) prefix, each with its own
question, added at once and run to completion, on an engine whose pool holds their own blocks and
one copy of the prefix, the tier on in both sides: "device", the prefix served once and left in
the pool; "host", served once and then pushed into the tier by other prompts (until the pool holds
none of it and the tier all of it; their blocks, evictable, are evicted as the requests need room,
as a busy worker's would be). Target: host throughput at least 0.95x device (one load of the
prefix, not one per request). Sides alternated, medians over the repeats.

Each part can be skipped (`--skip-working-set`, `--skip-long-prefix`, `--skip-peer`,
`--skip-shared`); each prints the command that runs it alone.

Then, with `--soak-minutes M` (default 0: none; fractions allowed), the issue's "a 30-minute soak
under (a): both tiers' memory stays within their budgets, nothing leaks": case (a)'s tenants and
pool on one fresh engine with the tier on, for M minutes, but a tier of only
`--soak-tier-fraction` (default 0.5) of the working set (2x the pool at the default 4x working
set), so both tiers evict all the time. Requests go round-robin over the tenants, each pass in a
fresh random order (a strict cycle over more tenants than the tiers hold would never hit the
tier: least-recently-used drops exactly the prefix the next request needs), each with a fresh
question; block announcements are drained after every step, as the worker does. Every
`--soak-sample-s` seconds (default 30) a sample: requests done, the process's RSS, Python's
tracked objects (after a gc.collect()), the pool's blocks, the tier's bytes and counters, and the
block manager's invariants. The verdicts (any failed: exit status 1): the tier's used bytes within
its capacity at every sample; the pool's blocks within its total and its invariants holding at
every sample; no leak (RSS and object growth from the first sample a sample interval after the
first pass over the tenants, when both tiers are full and touched, to the last, within
`leak_bounds`); the tier churned (blocks evicted from it and restored from it).

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
import math
import platform
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from benchmarks.engine_throughput import greedy, load_model
from benchmarks.prefix_cache import percentile, random_tokens, run_at_once
from kvfleet.shared.models import DEFAULT_MODEL, resolve_model_path
from kvfleet.shared.wire.prefix_hash import BlockHash, block_hashes
from kvfleet.worker.engine.engine import Engine, EngineConfig
from kvfleet.worker.engine.tiers.prefix_copies import PrefixState
from kvfleet.worker.handoff.peer_prefixes import parse_prefix_id, prefix_id
from kvfleet.worker.handoff.transfer import Outgoing, TcpTransferPlane

PEER_TARGET = 5.0  # a peer fetch + TTFT at least 5x faster than recomputing the prefix
SHARED_TARGET = 0.95  # case (c): host-tier throughput at least 0.95x the all-device-hit one
FETCH_TIMEOUT_S = 120.0
MIB = 1 << 20
GIB = 1 << 30
# the soak's leak bounds (leak_bounds): RSS may grow by max(64 MiB, 2% of the first RSS after
# warm-up), Python's tracked objects by 5% of theirs plus 10,000
SOAK_RSS_SLACK_BYTES = 64 * MIB
SOAK_RSS_FRACTION = 0.02
SOAK_OBJECTS_FRACTION = 0.05
SOAK_OBJECTS_SLACK = 10_000


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


def verdict(ratio: float, target: float) -> str:
    return "MET" if ratio >= target else "MISSED"


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


def peer_ratio(recompute_ttft_s: float, fetch_s: float, ttft_after_fetch_s: float) -> float:
    """How many times faster a prefix fetched from a peer gets its first token than one
    recomputed: the recomputing engine's TTFT over the fetch and the fetching engine's TTFT."""
    return recompute_ttft_s / (fetch_s + ttft_after_fetch_s)


class Setup:
    """What the parts share: the model in the engine's dtype, its block size and block bytes."""

    def __init__(self, args):
        path = resolve_model_path(args.model)
        probe = Engine(load_model(path, torch.float32),
                       EngineConfig(device="cpu", dtype=args.dtype, num_blocks=4))
        self.dtype, self.block_size = probe.dtype, probe.config.block_size
        self.block_bytes, self.vocab_size = probe.pool.block_bytes, probe.model.config.vocab_size
        self.max_model_len = probe.max_model_len
        del probe
        self.model = load_model(path, self.dtype)

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def gib(self, num_blocks: int) -> float:
        return num_blocks * self.block_bytes / (1 << 30)


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


def working_set_pool(args, setup: Setup) -> tuple[int, int]:
    """Case (a)'s working set (tokens) and the pool (blocks) it is `--working-set-ratio` times."""
    working_set = args.tenants * args.prefix_tokens
    num_blocks = int(working_set / args.working_set_ratio) // setup.block_size
    request_blocks = setup.blocks(args.prefix_tokens + args.question_tokens + args.max_tokens)
    if num_blocks <= request_blocks:
        sys.exit(f"a pool of {num_blocks} blocks would not hold one request ({request_blocks}): "
                 f"more tenants, or a smaller --working-set-ratio")
    return working_set, num_blocks


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
    return {"command": part_command(args, "long_prefix"), "ttft_s": ttft, "ratio": ratio,
            "target": 5.0, "verdict": verdict(ratio, 5)}


# ---- the parts that run requests by hand: one batch at a time ------------------------------------


@dataclass
class Batch:
    """Requests added at once and run to completion."""

    seconds: float  # from the first add to the step that finished the last one
    ttft_s: list[float]  # each one's add to the step that returned its first token
    outputs: list[list[int]]

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def run_batch(engine: Engine, label: str, prompts: list[list[int]], max_tokens: int) -> Batch:
    """`prompts` added at once (greedy, `max_tokens` each) and stepped until every one ends."""
    seconds, ttft, outputs = run_at_once(engine, label, prompts, [max_tokens] * len(prompts))
    return Batch(seconds, list(ttft), outputs)


def prompt_hashes(engine: Engine, prompt: list[int]) -> list[BlockHash]:
    """The block hashes of `prompt` a lookup could hit: its full blocks but one token's."""
    block_size = engine.config.cache.block_size
    return block_hashes(prompt, block_size, engine.block_manager.root,
                        (len(prompt) - 1) // block_size)


def fresh(setup: Setup, config: EngineConfig) -> Engine:
    return Engine(copy.deepcopy(setup.model), config)


# ---- a long prefix fetched from a peer ----------------------------------------------------------


def holder(engine: Engine):
    """A transfer plane's `provide` over `engine`'s prefix blocks. In the product the holder's
    loop answers between two of its steps (peer_prefixes.PeerPrefixes.provide); here the holder
    is idle while it is asked, so the plane's thread exports from it directly."""

    def provide(request_id: str) -> Outgoing | None:
        hashes = parse_prefix_id(request_id)
        state = None if hashes is None else engine.prefixes.export(hashes)
        if state is None:
            return None
        header, buffers = state.encode()
        return Outgoing(header, buffers)

    return provide


@dataclass
class PeerRun:
    """One repeat: A computed the prefix, B fetched it and served, C recomputed it."""

    fetch_s: float  # B: the plane's fetch (A's export, the wire), decode, install
    wire_s: float  # of it, the payload on the wire
    bytes: int  # the header and the payload
    payload_bytes: int  # of them, the blocks' KV
    blocks: int  # installed in B
    ttft_after_fetch_s: float  # B's request: add to its first token
    recompute_ttft_s: float  # C's
    peer_hit_tokens: int  # B's request's prompt tokens found installed
    answers_match: bool  # B's tokens are C's

    @property
    def fetch_plus_ttft_s(self) -> float:
        return self.fetch_s + self.ttft_after_fetch_s

    @property
    def ratio(self) -> float:
        return peer_ratio(self.recompute_ttft_s, self.fetch_s, self.ttft_after_fetch_s)

    def line(self) -> str:
        return (f"  fetch {self.blocks} blocks, {self.bytes / 1e6:.2f} MB in "
                f"{self.fetch_s * 1000:.1f} ms ({self.bytes / self.fetch_s / 1e6:.0f} MB/s end to "
                f"end; on the wire {self.wire_s * 1000:.2f} ms), TTFT after it "
                f"{self.ttft_after_fetch_s * 1000:.1f} ms; recomputed TTFT "
                f"{self.recompute_ttft_s * 1000:.1f} ms = {self.ratio:.1f}x; answers match: "
                f"{self.answers_match}")


def peer_once(args, setup: Setup, config: EngineConfig, prefix: list[int], tail: list[int],
              question: list[int], repeat: int) -> PeerRun:
    prompt = prefix + question
    engine_a = fresh(setup, config)
    run_batch(engine_a, f"peer-a{repeat}", [prefix + tail], 1)
    source = TcpTransferPlane("127.0.0.1", 0, "127.0.0.1")
    taker = TcpTransferPlane("127.0.0.1", 0, "127.0.0.1")  # fetches only: never started
    try:
        addr = source.start(holder(engine_a))
        engine_b = fresh(setup, config)
        hashes = prompt_hashes(engine_b, prompt)
        start = time.perf_counter()
        header, payload = taker.fetch(addr, prefix_id(hashes), FETCH_TIMEOUT_S)
        installed = engine_b.prefixes.install(PrefixState.decode(header, payload))
        fetch_s = time.perf_counter() - start
    finally:
        source.close()
        taker.close()
    size, payload_size = len(header) + payload.nbytes, payload.nbytes
    del engine_a, header, payload
    gc.collect()
    if installed != len(prefix) // setup.block_size:
        raise RuntimeError(f"{installed} prefix blocks installed, not "
                           f"{len(prefix) // setup.block_size}")

    def recompute() -> Batch:
        engine_c = fresh(setup, config)
        done = run_batch(engine_c, f"peer-c{repeat}", [prompt], args.max_tokens)
        del engine_c
        gc.collect()
        return done

    recomputed = recompute() if repeat % 2 else None  # alternated: C first on odd repeats
    fetched = run_batch(engine_b, f"peer-b{repeat}", [prompt], args.max_tokens)
    peer_hit_tokens = engine_b.stats().prefix_peer_hit_tokens
    del engine_b
    gc.collect()
    recomputed = recomputed or recompute()
    return PeerRun(fetch_s, taker.stats.payload_seconds, size, payload_size, installed,
                   fetched.ttft_s[0], recomputed.ttft_s[0], peer_hit_tokens,
                   fetched.outputs == recomputed.outputs)


def peer_part(args, setup: Setup) -> dict:
    rng = random.Random(args.seed + 2)
    prefix = random_tokens(rng, args.long_prefix_tokens, setup.vocab_size)
    tail = random_tokens(rng, 4, setup.vocab_size)
    question = random_tokens(rng, args.question_tokens, setup.vocab_size)
    num_blocks = setup.blocks(args.long_prefix_tokens + args.question_tokens + args.max_tokens) + 1
    config = EngineConfig(device="cpu", dtype=args.dtype, num_blocks=num_blocks, max_running=1)
    print(f"\n## one {args.long_prefix_tokens:,}-token prefix fetched from a peer over a "
          f"TcpTransferPlane on loopback (export, wire, decode, install), then its request's "
          f"TTFT; against a fresh engine recomputing it\n{part_command(args, 'peer')}",
          flush=True)
    runs = []
    for repeat in range(args.repeats):
        runs.append(peer_once(args, setup, config, prefix, tail, question, repeat))
        print(runs[-1].line(), flush=True)
    median = {name: statistics.median(getattr(r, name) for r in runs)
              for name in ("fetch_s", "wire_s", "bytes", "payload_bytes", "ttft_after_fetch_s",
                           "fetch_plus_ttft_s", "recompute_ttft_s")}
    median["mb_per_s"] = median["bytes"] / median["fetch_s"] / 1e6  # end to end
    median["wire_mb_per_s"] = (median["payload_bytes"] / median["wire_s"] / 1e6
                               if median["wire_s"] else 0.0)
    ratio = peer_ratio(median["recompute_ttft_s"], median["fetch_s"], median["ttft_after_fetch_s"])
    answers_match = all(r.answers_match for r in runs)
    print(f"RATIO {args.long_prefix_tokens:,}-token prefix fetched from a peer vs recomputed: "
          f"fetch {median['fetch_s'] * 1000:.1f} ms ({median['bytes'] / 1e6:.2f} MB, "
          f"{median['mb_per_s']:.0f} MB/s) + TTFT {median['ttft_after_fetch_s'] * 1000:.1f} ms "
          f"= {median['fetch_plus_ttft_s'] * 1000:.1f} ms vs TTFT recomputed "
          f"{median['recompute_ttft_s'] * 1000:.1f} ms = {ratio:.1f}x (target >= "
          f"{PEER_TARGET:g}x) -> {verdict(ratio, PEER_TARGET)}")
    print(f"answers after the fetch identical to recomputed: {answers_match}", flush=True)
    return {"prefix_tokens": args.long_prefix_tokens, "command": part_command(args, "peer"),
            "median": median, "ratio": ratio, "target": PEER_TARGET,
            "verdict": verdict(ratio, PEER_TARGET), "answers_match": answers_match,
            "runs": [{**vars(r), "ratio": r.ratio} for r in runs]}


# ---- case (c): concurrent requests sharing a prefix in the host tier ---------------------------


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


def shared_part(args, setup: Setup) -> dict:
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
          f"GiB\n{part_command(args, 'shared')}", flush=True)
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
            "command": part_command(args, "shared"), "median": median, "ratio": ratio,
            "target": SHARED_TARGET, "verdict": verdict(ratio, SHARED_TARGET),
            "identical": identical,
            "runs": {label: [{k: v for k, v in vars(s).items() if k != "outputs"} for s in runs]
                     for label, runs in sides.items()}}


# ---- the soak: case (a) for minutes, both tiers under pressure ----------------------------------


def rss_bytes() -> int:
    """The process's resident set now (/proc/self/status VmRSS); where there is no /proc, its
    peak (getrusage), an upper bound."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


@dataclass
class SoakSample:
    """One look at the soaking engine and the process, between two steps."""

    t_s: float  # since the soak's first request
    requests: int  # finished
    rss_bytes: int
    gc_objects: int  # len(gc.get_objects()) after a gc.collect()
    pool_total: int  # blocks
    pool_free: int  # of them, those no request holds (evictable cached ones included)
    pool_cached: int  # blocks published in the prefix cache
    tier_used_bytes: int
    tier_capacity_bytes: int
    offloaded: int  # the tier's counters: blocks copied in,
    evicted: int  # dropped for room,
    restored: int  # copied back into the pool
    invariants: str = ""  # the block manager's check_invariants: "" if it passed, else why not

    @property
    def pool_used(self) -> int:
        return self.pool_total - self.pool_free

    def row(self) -> str:
        return (f"| {self.t_s:7.1f} | {self.requests:6,} | {self.rss_bytes / MIB:8.1f} | "
                f"{self.gc_objects:9,} | {self.pool_used}/{self.pool_total} "
                f"({self.pool_cached} cached) | {self.tier_used_bytes / MIB:.1f}/"
                f"{self.tier_capacity_bytes / MIB:.1f} | {self.offloaded:,} | {self.evicted:,} | "
                f"{self.restored:,} |" + (f" INVARIANTS: {self.invariants}" if self.invariants
                                           else ""))


SOAK_HEADER = ("| t (s) | requests | RSS MiB | objects | pool used/total blocks | tier "
               "used/capacity MiB | offloaded | evicted | restored |\n"
               "|---|---|---|---|---|---|---|---|---|")


def take_sample(engine: Engine, t_s: float, requests: int) -> SoakSample:
    try:
        engine.block_manager.check_invariants()
        invariants = ""
    except AssertionError as e:
        invariants = str(e) or "AssertionError"
    s = engine.stats()
    gc.collect()
    return SoakSample(t_s, requests, rss_bytes(), len(gc.get_objects()), s.num_blocks_total,
                      s.num_blocks_free, s.num_cached_blocks, s.kv_offload_used_bytes,
                      s.kv_offload_capacity_bytes, s.kv_offloaded_blocks,
                      s.kv_offload_evicted_blocks, s.kv_offload_restored_blocks, invariants)


@dataclass
class Check:
    """One of the soak's verdicts."""

    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"SOAK {self.name}: {'PASS' if self.ok else 'FAIL'} ({self.detail})"


def tier_within_budget(samples: list[SoakSample]) -> Check:
    """The host tier's used bytes within its capacity at every sample."""
    over = [s for s in samples if not 0 <= s.tier_used_bytes <= s.tier_capacity_bytes]
    top = max(samples, key=lambda s: s.tier_used_bytes)
    detail = (f"most used {top.tier_used_bytes / MIB:.2f} of {top.tier_capacity_bytes / MIB:.2f} "
              f"MiB at {top.t_s:.0f} s, over {len(samples)} samples")
    if over:
        detail += (f"; over its capacity at {len(over)} samples, first at {over[0].t_s:.0f} s: "
                   f"{over[0].tier_used_bytes:,} > {over[0].tier_capacity_bytes:,} bytes")
    return Check("host tier within its budget", bool(samples) and not over and
                 top.tier_capacity_bytes > 0, detail)


def pool_within_budget(samples: list[SoakSample]) -> Check:
    """The pool's used and cached blocks within its total, and the block manager's invariants
    holding, at every sample."""
    over = [s for s in samples if not (0 <= s.pool_free <= s.pool_total
                                       and 0 <= s.pool_cached <= s.pool_total)]
    broken = [s for s in samples if s.invariants]
    top = max(samples, key=lambda s: s.pool_used)
    detail = (f"most used {top.pool_used} of {top.pool_total} blocks at {top.t_s:.0f} s; "
              f"invariants held at {len(samples) - len(broken)} of {len(samples)} samples")
    if over:
        detail += f"; blocks out of range at {len(over)} samples, first at {over[0].t_s:.0f} s"
    if broken:
        detail += f"; first broken at {broken[0].t_s:.0f} s: {broken[0].invariants}"
    return Check("pool within its blocks, invariants hold", bool(samples) and not over
                 and not broken, detail)


def leak_bounds(baseline: SoakSample) -> tuple[int, int]:
    """(RSS bytes, tracked objects) the process may grow by from `baseline`, the first sample
    after warm-up. By then the pool and the tier are full (every page of both touched) and every
    code path has run: what may still grow is the allocators' caches and fragmentation, which
    level off, and gc's generations in flux. A leak of anything per request (a block, a
    request's record) grows without bound over a long soak and passes these."""
    return (max(SOAK_RSS_SLACK_BYTES, int(SOAK_RSS_FRACTION * baseline.rss_bytes)),
            int(SOAK_OBJECTS_FRACTION * baseline.gc_objects) + SOAK_OBJECTS_SLACK)


def baseline_index(samples: list[SoakSample], warm_s: float | None,
                   sample_s: float) -> int | None:
    """The first sample a sample interval after the first pass over the tenants (`warm_s`,
    None if it never ended); None if there is none."""
    if warm_s is None:
        return None
    return next((i for i, s in enumerate(samples) if s.t_s >= warm_s + sample_s), None)


def no_leak(samples: list[SoakSample], baseline: int | None) -> list[Check]:
    """RSS and tracked objects grew from samples[baseline] to the last within `leak_bounds`."""
    if baseline is None or baseline >= len(samples) - 1:
        detail = "too short: no two samples after warm-up (the first pass over the tenants and " \
                 "one sample interval); soak longer or sample more often"
        return [Check("no RSS leak", False, detail), Check("no object leak", False, detail)]
    first, last = samples[baseline], samples[-1]
    rss_bound, objects_bound = leak_bounds(first)
    rss_growth = last.rss_bytes - first.rss_bytes
    peak_rss = max(s.rss_bytes for s in samples[baseline:])
    objects_growth = last.gc_objects - first.gc_objects
    span = (f"from {first.t_s:.0f} s to {last.t_s:.0f} s, "
            f"{last.requests - first.requests:,} requests")
    return [
        Check("no RSS leak", rss_growth < rss_bound,
              f"RSS {first.rss_bytes / MIB:.1f} -> {last.rss_bytes / MIB:.1f} MiB "
              f"({rss_growth / MIB:+.1f} MiB; peak {peak_rss / MIB:.1f}) {span}; bound "
              f"< {rss_bound / MIB:.1f} MiB = max({SOAK_RSS_SLACK_BYTES / MIB:.0f} MiB, "
              f"{SOAK_RSS_FRACTION:.0%} of the first)"),
        Check("no object leak", objects_growth < objects_bound,
              f"tracked objects {first.gc_objects:,} -> {last.gc_objects:,} "
              f"({objects_growth:+,}) {span}; bound < {objects_bound:,} = "
              f"{SOAK_OBJECTS_FRACTION:.0%} of the first + {SOAK_OBJECTS_SLACK:,}")]


def tier_churned(samples: list[SoakSample]) -> Check:
    """The tier evicted blocks for room and gave blocks back: it was under pressure and used."""
    last = samples[-1]
    return Check("tier churned", last.evicted > 0 and last.restored > 0,
                 f"offloaded {last.offloaded:,}, evicted {last.evicted:,}, restored "
                 f"{last.restored:,} blocks")


def soak_verdicts(samples: list[SoakSample], warm_s: float | None,
                  sample_s: float) -> list[Check]:
    if not samples:
        return [Check("samples", False, "none taken")]
    return [tier_within_budget(samples), pool_within_budget(samples),
            *no_leak(samples, baseline_index(samples, warm_s, sample_s)), tier_churned(samples)]


def soak_part(args, setup: Setup) -> dict:
    working_set, num_blocks = working_set_pool(args, setup)
    tier_blocks = max(1, round(args.soak_tier_fraction * working_set / setup.block_size))
    tier_gib = (tier_blocks + 0.5) * setup.block_bytes / GIB  # exactly tier_blocks slots
    config = EngineConfig(device="cpu", dtype=args.dtype, num_blocks=num_blocks,
                          max_running=args.concurrency, kv_offloading_size=tier_gib)
    print(f"\n## soak under (a) for {args.soak_minutes:g} min: {args.tenants} tenants x "
          f"{args.prefix_tokens}-token prefix = {working_set:,} tokens, pool "
          f"{num_blocks * setup.block_size:,} tokens ({num_blocks} blocks, "
          f"{working_set / (num_blocks * setup.block_size):.1f}x), tier {tier_blocks} blocks "
          f"({tier_blocks * setup.block_size:,} tokens, {setup.gib(tier_blocks) * 1024:.1f} MiB: "
          f"{tier_blocks * setup.block_size / working_set:.2f} of the working set); round-robin "
          f"in a fresh order each pass, concurrency {args.concurrency}, max_tokens "
          f"{args.max_tokens}; a sample every {args.soak_sample_s:g} s\n"
          f"{part_command(args, 'soak')}", flush=True)
    rng = random.Random(args.seed + 4)
    prefixes = [random_tokens(rng, args.prefix_tokens, setup.vocab_size)
                for _ in range(args.tenants)]
    engine = fresh(setup, config)
    samples: list[SoakSample] = []
    added: dict[str, int] = {}  # request -> tokens so far
    order: list[int] = []  # this pass's tenants still to come
    issued = done = 0
    warm_s = None
    print(SOAK_HEADER, flush=True)

    def sample(t_s: float) -> None:
        samples.append(take_sample(engine, t_s, done))
        print(samples[-1].row(), flush=True)

    start = time.perf_counter()
    sample(0.0)
    next_sample = time.perf_counter() + args.soak_sample_s
    end = start + args.soak_minutes * 60
    while True:
        while time.perf_counter() < end and len(added) < args.concurrency:
            if not order:
                order = rng.sample(range(args.tenants), args.tenants)
            prompt = prefixes[order.pop()] + random_tokens(rng, args.question_tokens,
                                                           setup.vocab_size)
            req_id = f"soak-{issued}"
            engine.add_request(req_id, prompt, greedy(args.max_tokens))
            added[req_id] = 0
            issued += 1
        if not added:
            break
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"{out.req_id} failed: {out.error}")
            added[out.req_id] += len(out.new_token_ids)
            if out.finish_reason is not None:
                if added.pop(out.req_id) != args.max_tokens:
                    raise RuntimeError(f"{out.req_id} stopped short")
                done += 1
        engine.drain_block_announcements()  # as the worker does after each step
        now = time.perf_counter()
        if warm_s is None and done >= args.tenants:
            warm_s = now - start
        if now >= next_sample:
            sample(now - start)
            next_sample = time.perf_counter() + args.soak_sample_s
    sample(time.perf_counter() - start)
    del engine
    gc.collect()
    base = baseline_index(samples, warm_s, args.soak_sample_s)
    checks = soak_verdicts(samples, warm_s, args.soak_sample_s)
    seconds = samples[-1].t_s
    warm = (f"ended at {warm_s:.1f} s" if warm_s is not None else
            f"not over: {done} of its {args.tenants} requests done")
    print(f"\n{done:,} requests in {seconds:.0f} s ({done / seconds:.2f} req/s); warm-up (the "
          f"first pass over the tenants) {warm}; leak baseline: "
          + ("none" if base is None else f"the sample at {samples[base].t_s:.1f} s"))
    for check in checks:
        print(check.line())
    ok = all(c.ok for c in checks)
    print(f"SOAK verdict: {'PASS' if ok else 'FAIL'}", flush=True)
    return {"command": part_command(args, "soak"), "minutes": args.soak_minutes,
            "sample_s": args.soak_sample_s, "working_set_tokens": working_set,
            "num_blocks": num_blocks, "tier_blocks": tier_blocks,
            "tier_fraction": tier_blocks * setup.block_size / working_set,
            "requests": done, "seconds": seconds, "warm_s": warm_s, "baseline_index": base,
            "samples": [{**vars(s), "pool_used": s.pool_used} for s in samples],
            "verdicts": [vars(c) for c in checks], "ok": ok}


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
        results["peer"] = peer_part(args, setup)
    if args.shared_requests and not args.skip_shared:
        results["shared"] = shared_part(args, setup)
    if args.soak_minutes > 0:
        results["soak"] = soak_part(args, setup)
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
