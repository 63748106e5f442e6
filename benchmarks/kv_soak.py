"""The issue's "a 30-minute soak under (a): both tiers' memory stays within their budgets, nothing
leaks": case (a)'s tenants and pool on one fresh engine with the tier on, for `--soak-minutes M`
(default 0: none; fractions allowed), but a tier of only `--soak-tier-fraction` (default 0.5) of
the working set (2x the pool at the default 4x working set), so both tiers evict all the time.
Requests go round-robin over the tenants, each pass in a fresh random order (a strict cycle over
more tenants than the tiers hold would never hit the tier: least-recently-used drops exactly the
prefix the next request needs), each with a fresh question; block announcements are drained after
every step, as the worker does. Every `--soak-sample-s` seconds (default 30) a sample: requests
done, the process's RSS, Python's tracked objects (after a gc.collect()), the pool's blocks, the
tier's bytes and counters, and the block manager's invariants. The verdicts (any failed: exit
status 1): the tier's used bytes within its capacity at every sample; the pool's blocks within its
total and its invariants holding at every sample; no leak (RSS and object growth from the first
sample a sample interval after the first pass over the tenants, when both tiers are full and
touched, to the last, within `leak_bounds`); the tier churned (blocks evicted from it and restored
from it).

Runs through `python -m benchmarks.kv_tiers`, after the other parts, with `--soak-minutes M`;
alone: `--skip-working-set --skip-long-prefix --skip-peer --skip-shared --soak-minutes 30`."""

from __future__ import annotations

import gc
import random
import sys
import time
from dataclasses import dataclass

from benchmarks.engine_throughput import greedy
from benchmarks.kv_tiers_common import Setup, fresh, working_set_pool
from benchmarks.prefix_cache import random_tokens
from kvfleet.worker.engine.engine import Engine, EngineConfig

MIB = 1 << 20
GIB = 1 << 30
# the soak's leak bounds (leak_bounds): RSS may grow by max(64 MiB, 2% of the first RSS after
# warm-up), Python's tracked objects by 5% of theirs plus 10,000
SOAK_RSS_SLACK_BYTES = 64 * MIB
SOAK_RSS_FRACTION = 0.02
SOAK_OBJECTS_FRACTION = 0.05
SOAK_OBJECTS_SLACK = 10_000


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


def soak_part(args, setup: Setup, command: str) -> dict:
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
          f"{command}", flush=True)
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

    def over() -> bool:
        """The soak's minutes are up and the leak checks have their baseline (a sample one
        interval after warm-up; the final sample comes after it). A short soak on a slow host,
        where samples come late, goes on until they do rather than give no verdict."""
        return (time.perf_counter() >= end
                and baseline_index(samples, warm_s, args.soak_sample_s) is not None)

    start = time.perf_counter()
    sample(0.0)
    next_sample = time.perf_counter() + args.soak_sample_s
    end = start + args.soak_minutes * 60
    while True:
        while not over() and len(added) < args.concurrency:
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
    if seconds > args.soak_minutes * 60 + args.soak_sample_s:
        print(f"\n(the soak went on to {seconds:.0f} s: the leak checks need a sample one "
              f"interval after warm-up and one after that)")
    warm = (f"ended at {warm_s:.1f} s" if warm_s is not None else
            f"not over: {done} of its {args.tenants} requests done")
    print(f"\n{done:,} requests in {seconds:.0f} s ({done / seconds:.2f} req/s); warm-up (the "
          f"first pass over the tenants) {warm}; leak baseline: "
          + ("none" if base is None else f"the sample at {samples[base].t_s:.1f} s"))
    for check in checks:
        print(check.line())
    ok = all(c.ok for c in checks)
    print(f"SOAK verdict: {'PASS' if ok else 'FAIL'}", flush=True)
    return {"command": command, "minutes": args.soak_minutes,
            "sample_s": args.soak_sample_s, "working_set_tokens": working_set,
            "num_blocks": num_blocks, "tier_blocks": tier_blocks,
            "tier_fraction": tier_blocks * setup.block_size / working_set,
            "requests": done, "seconds": seconds, "warm_s": warm_s, "baseline_index": base,
            "samples": [{**vars(s), "pool_used": s.pool_used} for s in samples],
            "verdicts": [vars(c) for c in checks], "ok": ok}
