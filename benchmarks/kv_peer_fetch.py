"""A long prefix fetched from a peer against recomputing it (worker/handoff/peer_prefixes.py;
target: a fetch at least 5x faster than recomputing it): engine A computes the prefix (one
request, the prefix and a few tokens, max_tokens 1); a fresh engine B of the same config fetches
its blocks from A over a real TcpTransferPlane on loopback (export, the wire, decode, install:
timed) and then serves the prefix with a new question (its TTFT); a third fresh engine C serves
that prompt computing all of it. The ratio is C's TTFT over B's fetch + TTFT; B's answer must be
C's (greedy). In the product the holder's loop answers a fetch between two of its steps; here A
is idle, so the plane's thread exports from it directly. Medians over `--repeats`.

Runs through `python -m benchmarks.kv_tiers` (its prefix: `--long-prefix-tokens`; alone:
`--skip-working-set --skip-long-prefix --skip-shared`; skipped: `--skip-peer`)."""

from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import dataclass

from benchmarks.kv_tiers_common import Batch, Setup, fresh, prompt_hashes, run_batch, verdict
from benchmarks.prefix_cache import random_tokens
from kvfleet.worker.engine.engine import Engine, EngineConfig
from kvfleet.worker.engine.tiers.prefix_copies import PrefixState
from kvfleet.worker.handoff.peer_prefixes import parse_prefix_id, prefix_id
from kvfleet.worker.handoff.transfer import Outgoing, TcpTransferPlane

PEER_TARGET = 5.0  # a peer fetch + TTFT at least 5x faster than recomputing the prefix
FETCH_TIMEOUT_S = 120.0


def peer_ratio(recompute_ttft_s: float, fetch_s: float, ttft_after_fetch_s: float) -> float:
    """How many times faster a prefix fetched from a peer gets its first token than one
    recomputed: the recomputing engine's TTFT over the fetch and the fetching engine's TTFT."""
    return recompute_ttft_s / (fetch_s + ttft_after_fetch_s)


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


def peer_part(args, setup: Setup, command: str) -> dict:
    rng = random.Random(args.seed + 2)
    prefix = random_tokens(rng, args.long_prefix_tokens, setup.vocab_size)
    tail = random_tokens(rng, 4, setup.vocab_size)
    question = random_tokens(rng, args.question_tokens, setup.vocab_size)
    num_blocks = setup.blocks(args.long_prefix_tokens + args.question_tokens + args.max_tokens) + 1
    config = EngineConfig(device="cpu", dtype=args.dtype, num_blocks=num_blocks, max_running=1)
    print(f"\n## one {args.long_prefix_tokens:,}-token prefix fetched from a peer over a "
          f"TcpTransferPlane on loopback (export, wire, decode, install), then its request's "
          f"TTFT; against a fresh engine recomputing it\n{command}",
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
    return {"prefix_tokens": args.long_prefix_tokens, "command": command,
            "median": median, "ratio": ratio, "target": PEER_TARGET,
            "verdict": verdict(ratio, PEER_TARGET), "answers_match": answers_match,
            "runs": [{**vars(r), "ratio": r.ratio} for r in runs]}

