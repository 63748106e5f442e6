"""Prometheus metrics of one worker: what its engine did each step, on a registry of its own.

The service loop calls `request_started` when it admits a request and `step_done` after every
engine step; a Prometheus server scrapes `serve()`'s endpoint (or the loop reads `render()`).
Names start with `kvfleet_worker_`; every series carries `model` and `worker` labels.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, generate_latest,
                               start_http_server)

from kvfleet.worker.tier_metrics import TierMetrics, TierStats

# Queue wait: from the gateway's XADD to this worker's admission; 1 ms .. 10 min.
QUEUE_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                        30.0, 60.0, 120.0, 300.0, 600.0)
# One engine step (one forward over the batch): sub-millisecond on a tiny model .. seconds on CPU.
STEP_TIME_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05,
                       0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0)
# A stream's time between two tokens, and its first token from the enqueue (the promised pace).
ITL_BUCKETS_S = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.125, 0.15,
                 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
TTFT_BUCKETS_S = (0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)
HANDOFF_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LABELS = ("model", "worker")


class StepOutput(Protocol):
    """What the metrics read of `worker.engine.engine.RequestOutput`."""

    new_token_ids: list[int]
    finish_reason: str | None


class StepStats(TierStats, Protocol):
    """What the metrics read of `worker.engine.engine.EngineStats` (counts are cumulative)."""

    num_blocks_total: int
    num_blocks_free: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_swap_preemptions: int
    swap_used_bytes: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_cached_blocks: int
    num_prefill_tokens_computed: int
    num_constrained: int
    grammar_compiles: int
    grammar_cache_hits: int
    num_cuda_graph_steps: int
    sim_steps: int
    sim_lagged_steps: int
    spec_num_drafts: int
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    spec_accepted_per_position: tuple[int, ...]


class TokenRate:
    """Output tokens/s over a sliding window, decaying to 0 when the worker goes idle.

    The rate is read at scrape time, so an idle worker (no steps, no `step_done` calls) reads 0
    once its last tokens leave the window rather than the rate of its last busy step.
    """

    def __init__(self, window_s: float, clock: Callable[[], float]):
        self.window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, int]] = deque()  # (monotonic time, tokens)
        self._started_at: float | None = None  # when the first observed step began
        self._lock = threading.Lock()  # the scrape thread reads while the loop appends

    def add(self, num_tokens: int, step_time_s: float) -> None:
        now = self._clock()
        with self._lock:
            if self._started_at is None:
                self._started_at = now - step_time_s
            if num_tokens:
                self._samples.append((now, num_tokens))
            self._expire(now)

    def per_s(self) -> float:
        now = self._clock()
        with self._lock:
            self._expire(now)
            if self._started_at is None:
                return 0.0
            # A young worker divides by the time it has existed, not by the whole window.
            span_s = min(self.window_s, now - self._started_at)
            if span_s <= 0:
                return 0.0
            return sum(n for _, n in self._samples) / span_s

    def _expire(self, now: float) -> None:
        while self._samples and self._samples[0][0] <= now - self.window_s:
            self._samples.popleft()


class CumulativeDelta:
    """Turns a cumulative engine count into counter increments (a restarted engine starts over)."""

    def __init__(self) -> None:
        self._last = 0

    def step(self, value: int) -> int:
        delta = value - self._last if value >= self._last else value
        self._last = value
        return delta


class WorkerMetrics:
    """Counters, gauges and histograms of one worker serving one model."""

    def __init__(self, worker_id: str, model: str, cost_per_hour: float | None = None, *,
                 rate_window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.worker_id = worker_id
        self.model = model
        self.cost_per_hour = cost_per_hour
        self.registry = CollectorRegistry(auto_describe=True)
        self._rate = TokenRate(rate_window_s, clock)
        self._preemptions = CumulativeDelta()
        self._swap_preemptions = CumulativeDelta()
        self._prefill = CumulativeDelta()
        self._queried = CumulativeDelta()
        self._hits = CumulativeDelta()
        self._compiles = CumulativeDelta()
        self._grammar_hits = CumulativeDelta()
        self._graph_steps = CumulativeDelta()
        self._sim_steps, self._sim_lagged = CumulativeDelta(), CumulativeDelta()
        self._spec_drafts = CumulativeDelta()
        self._spec_draft_tokens = CumulativeDelta()
        self._spec_accepted = CumulativeDelta()
        self._spec_per_position: list[CumulativeDelta] = []
        self._deferred = CumulativeDelta()
        self._lora_loads: dict[str, CumulativeDelta] = {}
        self._lora_evictions: dict[str, CumulativeDelta] = {}
        self._server = None
        self._build_counters()
        self._build_gauges()
        self._build_histograms()
        self.tier = TierMetrics(self.registry, LABELS, self._labels(), CumulativeDelta)

    # ---- metric definitions --------------------------------------------------------------

    def _labels(self) -> dict[str, str]:
        return {"model": self.model, "worker": self.worker_id}

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, LABELS, registry=self.registry).labels(**self._labels())

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, LABELS, registry=self.registry).labels(**self._labels())

    def _build_counters(self) -> None:
        p = "kvfleet_worker_"
        self.requests_started = self._counter(
            p + "requests_started", "Requests admitted into the engine (new or resumed).")
        self._finished = Counter(p + "requests_finished", "Requests finished, by finish reason "
                                 "(stop, length, abort, error).", LABELS + ("outcome",),
                                 registry=self.registry)
        self.requests_stolen = self._counter(
            p + "requests_stolen", "Requests admitted from a stream shard other than this "
            "worker's home shards (entries that had waited --steal-after-ms).")
        self._taken = Counter(
            p + "requests_taken", "Requests admitted from a request stream, by source: own (this "
            "worker's own streams, routed to it for its prefix cache), shared (the model's "
            "shared streams), other (another worker's own streams, after "
            "--affinity-steal-after-ms or at once when that worker is gone or full).",
            LABELS + ("source",), registry=self.registry)
        self._announced_blocks = Counter(
            p + "kv_announced_blocks", "Prefix-cache blocks announced to the fleet's index, by "
            "change (stored, removed, host: moved to the host tier).", LABELS + ("change",), registry=self.registry)
        self.announcements = self._counter(
            p + "kv_announcements", "Announcements that carried a change of the prefix cache "
            "(one per step that changed it; the heartbeat's refreshes not counted).")
        self.prompt_tokens = self._counter(
            p + "prompt_tokens", "Prompt tokens computed by prefill (prefix-cache hits excluded).")
        self.output_tokens = self._counter(p + "output_tokens", "Output tokens generated.")
        self.token_events = self._counter(
            p + "token_events", "Token events published (checkpoint + publish, one Redis event "
            "each); output_tokens / token_events is the tokens an event carried on average "
            "(above 1 with --publish-interval-ms).")
        self.preemptions = self._counter(
            p + "preemptions", "Streams preempted because the KV block pool ran out.")
        self.swap_preemptions = self._counter(
            p + "preemptions_swapped",
            "Of those preemptions, the ones that kept the stream's KV in host memory (the rest "
            "recompute it).")
        self.prefix_queried_tokens = self._counter(
            p + "prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hit_tokens = self._counter(
            p + "prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.")
        self.takeovers = self._counter(
            p + "takeovers", "Requests this worker took over from a worker whose heartbeat was "
            "gone (resumed from its checkpoint). Nonzero without a worker dying means a bug.")
        self.resumes_other_numerics = self._counter(
            p + "resumes_other_numerics", "Streams this worker continued (resumed, or taken "
            "over with their KV) on other numerics than their tokens so far were computed on: "
            "their answers may differ from an uninterrupted run's (docs/RELIABILITY.md).")
        self.grammar_compiles = self._counter(
            p + "grammar_compiles", "Output constraints compiled (grammar cache misses).")
        self.grammar_cache_hits = self._counter(
            p + "grammar_cache_hits", "Constrained requests whose grammar was already compiled.")
        self.cuda_graph_steps = self._counter(
            p + "cuda_graph_steps", "Decode steps run by replaying a captured CUDA graph (0 on "
            "CPU, with --cuda-graphs off|eager, and for steps with a prefill chunk).")
        self.sim_steps = self._counter(
            p + "sim_steps", "Steps a simulated worker played (worker/sim/; 0 on a real one).")
        self.sim_lagged_steps = self._counter(
            p + "sim_lagged_steps", "Steps a simulated worker ended later than modelled (the "
            "host too slow for the time scale): above 5% of sim_steps its figures do not hold.")

        # speculative decoding, in vLLM's names (vllm:spec_decode_*)
        self.spec_drafts = self._counter(
            p + "spec_decode_num_drafts", "Speculative decoding: a stream's step that verified "
            "proposed tokens (one draft).")
        self.spec_draft_tokens = self._counter(
            p + "spec_decode_num_draft_tokens", "Proposed tokens verified.")
        self.spec_accepted = self._counter(
            p + "spec_decode_num_accepted_tokens", "Proposed tokens accepted (each one a forward "
            "saved); accepted / draft tokens is the acceptance rate.")
        self._spec_per_pos = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos", "Proposed tokens accepted, by their "
            "position in the draft (0 = the first proposal).", LABELS + ("position",),
            registry=self.registry)

        # LoRA adapters (label `adapter`: the registered name)
        labels = LABELS + ("adapter",)
        self._lora_requests = Counter(
            p + "lora_requests", "Requests admitted under a LoRA adapter (new or resumed).",
            labels, registry=self.registry)
        self._lora_tokens = Counter(
            p + "lora_output_tokens", "Output tokens generated under a LoRA adapter.", labels,
            registry=self.registry)
        self._lora_load_count = Counter(
            p + "lora_loads", "LoRA adapters loaded from their directory into this worker's "
            "memory (a first use, or a use after an eviction).", labels, registry=self.registry)
        self._lora_eviction_count = Counter(
            p + "lora_evictions", "LoRA adapters dropped from this worker's memory to make room "
            "for another (--max-cpu-loras).", labels, registry=self.registry)


        # KV handoffs (worker/handoff/): streams moved worker to worker with their KV
        self._handoffs = Counter(
            p + "handoffs", "Streams moved with their KV, by direction: out (handed to a peer, "
            "which fenced it), in (taken from a peer and continued here without recompute).",
            LABELS + ("direction",), registry=self.registry)
        self._handoff_bytes = Counter(
            p + "handoff_bytes", "KV bytes moved by handoffs, by direction (out, in).",
            LABELS + ("direction",), registry=self.registry)
        self.itl_over_target = self._counter(
            p + "itl_over_target", "Times between two tokens of a stream longer than "
            "--target-itl-ms (against itl_seconds' count: the share that missed the pace).")
        self.ttft_over_target = self._counter(
            p + "ttft_over_target", "First tokens later than --target-ttft-ms.")
        self.pace_deferrals = self._counter(
            p + "pace_deferrals", "Times the scheduler left a waiting stream out of the group "
            "because the group with it would miss the pace.")
        self._handoff_fallbacks = Counter(
            p + "handoff_fallbacks", "Handoffs that did not complete, by reason: lease_expired "
            "(the source took its stream back), transfer_failed, incompatible (another layout: "
            "resumed from the checkpoint), checkpoint_mismatch (resumed from the checkpoint), "
            "lost (the lease was gone when the taker fenced it), given_back (left at a drain's "
            "end for checkpoint resume elsewhere).", LABELS + ("reason",), registry=self.registry)

    def _build_gauges(self) -> None:
        p = "kvfleet_worker_"
        self.running = self._gauge(p + "running", "Streams in the running batch.")
        self.constrained = self._gauge(
            p + "constrained_requests", "Requests in the engine whose output follows a grammar.")
        self.waiting = self._gauge(p + "waiting", "Requests admitted but waiting for KV blocks.")
        self.kv_blocks_total = self._gauge(p + "kv_blocks_total", "KV cache blocks in the pool.")
        self.kv_blocks_used = self._gauge(
            p + "kv_blocks_used", "KV blocks held by live streams (total - free).")
        self.kv_usage = self._gauge(p + "kv_usage_ratio", "Fraction of KV blocks in use (0..1).")
        self.swap_used = self._gauge(
            p + "swap_used_bytes", "Host memory held by the KV of swapped-out streams.")
        self.cached_blocks = self._gauge(
            p + "prefix_cache_blocks", "Blocks holding cached prefixes (reusable, evictable).")
        self.hit_rate = self._gauge(
            p + "prefix_cache_hit_ratio",
            "Prefix-cache hit rate since start: hit / queried tokens.")
        self.indexed_blocks = self._gauge(
            p + "kv_indexed_blocks", "This worker's blocks in the fleet's prefix index (the size "
            "of its announced set in Redis, as the last announcement returned).")
        self.batch_invariant = self._gauge(
            p + "batch_invariant", "1 when every query row is computed batch-invariantly "
            "(--deterministic, and kernels that allow it: a resumed answer equals the "
            "uninterrupted one), else 0; the start-up log says why not.")
        self.lora_loaded = self._gauge(
            p + "lora_adapters_loaded", "LoRA adapters held in this worker's memory (at most "
            "--max-cpu-loras).")
        self._transfer_bytes = self._gauge(
            p + "handoff_received_payload_bytes", "KV payload bytes this worker's transfer plane "
            "received (handoffs taken).")
        self._transfer_seconds = self._gauge(
            p + "handoff_received_payload_seconds", "Seconds those payloads took on the wire, "
            "from a reply's header to its last byte (bytes / seconds: the plane's rate).")
        self.draining = self._gauge(
            p + "draining", "1 while this worker drains (SIGTERM or the admin route): it takes "
            "nothing new and hands its streams to peers.")
        self.handoff_offers = self._gauge(
            p + "handoff_offers", "Streams this worker offers to peers now (draining, or "
            "--role prefill after their first token).")
        self.target_itl = self._gauge(
            p + "target_itl_seconds", "The pace promised: the longest time between two tokens "
            "of a stream, p99 (--target-itl-ms; 0: none).")
        self.target_ttft = self._gauge(
            p + "target_ttft_seconds", "First token promised within this of the enqueue, p99 "
            "(--target-ttft-ms; 0: none).")
        self.itl_p99 = self._gauge(
            p + "itl_p99_seconds", "Time between two tokens of a stream here, p99 over the last "
            "minute (0: no sample).")
        self.pace_room = self._gauge(
            p + "pace_room", "More streams this worker takes now and keeps the pace (-1: no pace "
            "promised).")
        self.pace_streams = self._gauge(
            p + "pace_streams", "Streams this worker runs at the promised pace with its current "
            "mix (0: no promise).")
        self.step_cost_margin = self._gauge(
            p + "pace_margin", "Measured over predicted turn time at the 99th percentile: "
            "how far the host's noise stretches the fitted step cost.")
        tokens_per_s = self._gauge(
            p + "tokens_per_second", "Output tokens/s over the last rate window (default 10 s).")
        tokens_per_s.set_function(self._rate.per_s)
        if self.cost_per_hour is not None:
            price = self._gauge(p + "cost_per_hour_dollars",
                                "Configured price of this worker's accelerator, $/hour.")
            price.set(self.cost_per_hour)
            self._gauge(p + "cost_per_million_output_tokens_dollars",
                        "$ per 1M output tokens at the current tokens/s (NaN while idle)."
                        ).set_function(self.cost_per_million_tokens)

    def _build_histograms(self) -> None:
        p = "kvfleet_worker_"
        self.queue_wait = Histogram(
            p + "queue_wait_seconds", "Time from enqueue (gateway XADD) to admission by a worker.",
            LABELS, buckets=QUEUE_WAIT_BUCKETS_S, registry=self.registry).labels(**self._labels())
        self.step_time = Histogram(
            p + "step_duration_seconds",
            "Wall time of one engine step (schedule, forward, sample).",
            LABELS, buckets=STEP_TIME_BUCKETS_S, registry=self.registry).labels(**self._labels())
        self.steal_wait = Histogram(
            p + "steal_wait_seconds", "Time an entry taken from another worker's own stream had "
            "waited there (from its stream id's time to its admission here).",
            LABELS, buckets=QUEUE_WAIT_BUCKETS_S, registry=self.registry).labels(**self._labels())

        self.itl = Histogram(
            p + "itl_seconds", "Time between two tokens of a stream served here (a step that "
            "emits several, with speculation, counts once).",
            LABELS, buckets=ITL_BUCKETS_S, registry=self.registry).labels(**self._labels())
        self.ttft = Histogram(
            p + "ttft_seconds", "Time from a request's enqueue to its first token here (requests "
            "resumed past their first token are not counted).",
            LABELS, buckets=TTFT_BUCKETS_S, registry=self.registry).labels(**self._labels())
        self.handoff_time = Histogram(
            p + "handoff_seconds", "Taker's time from taking an offer to the stream's KV in its "
            "engine (the source's export between two steps, the transfer, the fence).",
            LABELS, buckets=HANDOFF_BUCKETS_S, registry=self.registry).labels(**self._labels())

    # ---- what the service loop calls -----------------------------------------------------

    def request_started(self, queue_wait_s: float | None) -> None:
        """A request was admitted; `queue_wait_s` = now - GenerationRequest.created for a first
        delivery, None for one resumed from a dead worker (its wait is not queueing)."""
        self.requests_started.inc()
        if queue_wait_s is not None:
            self.queue_wait.observe(max(queue_wait_s, 0.0))

    def stolen(self, count: int) -> None:
        """`count` requests were admitted from shards that are not this worker's home."""
        self.requests_stolen.inc(count)

    def taken(self, source: str, steal_wait_s: float | None = None) -> None:
        """A request was admitted from a stream of `source` (own, shared, other); from another
        worker's own stream, `steal_wait_s` is how long it had waited there."""
        self._taken.labels(source=source, **self._labels()).inc()
        if steal_wait_s is not None:
            self.steal_wait.observe(max(steal_wait_s, 0.0))

    def deliveries_taken(self, deliveries, from_home=None) -> None:
        """Admission counts of `deliveries` (worker/protocol.py Delivery): each one's source, the
        wait of those taken from another worker's own stream (a stream id starts with its XADD
        time, ms), and with home shards (`from_home`: whether a delivery came from one) those
        taken from a shard not home."""
        now_ms = time.time() * 1000
        for delivery in deliveries:
            waited_s = None
            if delivery.source == "other":
                waited_s = (now_ms - int(delivery.entry_id.split("-")[0])) / 1000
            self.taken(delivery.source, waited_s)
        if from_home is not None:
            self.stolen(sum(d.source == "shared" and not from_home(d) for d in deliveries))

    def blocks_announced(self, stored: int, removed: int, indexed: int, host: int = 0) -> None:
        """An announcement with a change went out; `indexed`: the set's size it returned."""
        self.announcements.inc()
        self._announced_blocks.labels(change="stored", **self._labels()).inc(stored)
        self._announced_blocks.labels(change="removed", **self._labels()).inc(removed)
        self._announced_blocks.labels(change="host", **self._labels()).inc(host)
        self.indexed_blocks.set(indexed)

    def numerics(self, fingerprint: str) -> None:
        """kvfleet_worker_numerics_info{fingerprint}: 1 for this worker's numerics fingerprint."""
        Gauge("kvfleet_worker_numerics_info", "This worker's numerics fingerprint (the label; "
              "worker/engine/model/numerics.py): workers with the same one continue each other's "
              "streams bit for bit.", LABELS + ("fingerprint",), registry=self.registry).labels(
            fingerprint=fingerprint, **self._labels()).set(1)

    def takeover(self) -> None:
        """A request of a dead worker was claimed to resume here."""
        self.takeovers.inc()

    def events_published(self, count: int) -> None:
        """`count` token events were checkpointed and published."""
        self.token_events.inc(count)

    def lora_request_started(self, adapter: str) -> None:
        self._lora_requests.labels(**self._labels(), adapter=adapter).inc()

    def lora_output_tokens(self, adapter: str, count: int) -> None:
        if count:
            self._lora_tokens.labels(**self._labels(), adapter=adapter).inc(count)

    def update_lora(self, loads: dict[str, int], evictions: dict[str, int],
                    num_loaded: int) -> None:
        """The engine's cumulative loads and evictions per adapter, and how many it holds."""
        for counts, deltas, counter in ((loads, self._lora_loads, self._lora_load_count),
                                        (evictions, self._lora_evictions,
                                         self._lora_eviction_count)):
            for adapter, count in counts.items():
                delta = deltas.setdefault(adapter, CumulativeDelta()).step(count)
                if delta:
                    counter.labels(**self._labels(), adapter=adapter).inc(delta)
        self.lora_loaded.set(num_loaded)

    def handoff(self, direction: str, num_bytes: int, seconds: float | None = None) -> None:
        """A stream moved with its KV (`direction` out or in); the taker reports its time."""
        self._handoffs.labels(direction=direction, **self._labels()).inc()
        self._handoff_bytes.labels(direction=direction, **self._labels()).inc(num_bytes)
        if seconds is not None:
            self.handoff_time.observe(seconds)

    def transfer_totals(self, payload_bytes: int, payload_seconds: float) -> None:
        """The transfer plane's received payload bytes and their seconds on the wire, so far."""
        self._transfer_bytes.set(payload_bytes)
        self._transfer_seconds.set(payload_seconds)

    def handoff_fallback(self, reason: str) -> None:
        self._handoff_fallbacks.labels(reason=reason, **self._labels()).inc()

    def request_finished(self, outcome: str) -> None:
        """A request left the engine (stop, length, abort, error) outside `step_done`."""
        self._finished.labels(outcome=outcome, **self._labels()).inc()

    def step_done(self, outputs: Iterable[StepOutput], stats: StepStats,
                  step_time_s: float) -> None:
        """After each engine step: its outputs, the engine's stats after it, its wall time."""
        new_tokens = 0
        for output in outputs:
            new_tokens += len(output.new_token_ids)
            if output.finish_reason is not None:
                self.request_finished(output.finish_reason)
        self.output_tokens.inc(new_tokens)
        self._rate.add(new_tokens, step_time_s)
        self.step_time.observe(max(step_time_s, 0.0))
        self.update_stats(stats)

    def update_stats(self, stats: StepStats) -> None:
        """Gauges and cumulative counters from the engine's stats (also usable while idle)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        used = stats.num_blocks_total - stats.num_blocks_free
        self.kv_blocks_total.set(stats.num_blocks_total)
        self.kv_blocks_used.set(used)
        self.kv_usage.set(used / stats.num_blocks_total if stats.num_blocks_total else 0.0)
        self.cached_blocks.set(stats.num_cached_blocks)
        self.hit_rate.set(stats.prefix_hit_tokens / stats.prefix_queried_tokens
                          if stats.prefix_queried_tokens else 0.0)
        self.preemptions.inc(self._preemptions.step(stats.num_preemptions))
        self.swap_preemptions.inc(self._swap_preemptions.step(stats.num_swap_preemptions))
        self.swap_used.set(stats.swap_used_bytes)
        self.prompt_tokens.inc(self._prefill.step(stats.num_prefill_tokens_computed))
        self.prefix_queried_tokens.inc(self._queried.step(stats.prefix_queried_tokens))
        self.prefix_hit_tokens.inc(self._hits.step(stats.prefix_hit_tokens))
        self.constrained.set(stats.num_constrained)
        self.grammar_compiles.inc(self._compiles.step(stats.grammar_compiles))
        self.grammar_cache_hits.inc(self._grammar_hits.step(stats.grammar_cache_hits))
        self.cuda_graph_steps.inc(self._graph_steps.step(stats.num_cuda_graph_steps))
        self.sim_steps.inc(self._sim_steps.step(stats.sim_steps))
        self.sim_lagged_steps.inc(self._sim_lagged.step(stats.sim_lagged_steps))
        self.tier.update(stats)
        self.spec_drafts.inc(self._spec_drafts.step(stats.spec_num_drafts))
        self.spec_draft_tokens.inc(self._spec_draft_tokens.step(stats.spec_num_draft_tokens))
        self.spec_accepted.inc(self._spec_accepted.step(stats.spec_num_accepted_tokens))
        for position, count in enumerate(stats.spec_accepted_per_position):
            if position == len(self._spec_per_position):
                self._spec_per_position.append(CumulativeDelta())
            delta = self._spec_per_position[position].step(count)
            if delta:
                self._spec_per_pos.labels(**self._labels(), position=str(position)).inc(delta)

    def update_pace(self, report, itl_s: Iterable[float], ttft_s: Iterable[float],
                    deferred: int) -> None:
        """The promised pace and how it is kept: `report` (engine.pace.PaceReport), the latencies
        measured since the last call, the admissions put off to keep it (cumulative)."""
        for seconds in itl_s:
            self.itl.observe(seconds)
            if report.target_itl_ms and seconds * 1000 > report.target_itl_ms:
                self.itl_over_target.inc()
        for seconds in ttft_s:
            self.ttft.observe(seconds)
            if report.target_ttft_ms and seconds * 1000 > report.target_ttft_ms:
                self.ttft_over_target.inc()
        self.target_itl.set(report.target_itl_ms / 1000)
        self.target_ttft.set(report.target_ttft_ms / 1000)
        self.itl_p99.set(report.itl_p99_ms / 1000)
        self.pace_room.set(report.room)
        self.pace_streams.set(report.streams)
        self.step_cost_margin.set(report.curve.margin)
        self.pace_deferrals.inc(self._deferred.step(deferred))

    # ---- derived numbers -----------------------------------------------------------------

    def tokens_per_s(self) -> float:
        return self._rate.per_s()

    def cost_per_million_tokens(self) -> float:
        """cost_per_hour / (tokens/s × 3600) × 1e6; NaN while idle or when no price is set."""
        rate = self._rate.per_s()
        if self.cost_per_hour is None or rate <= 0:
            return math.nan
        return self.cost_per_hour / (rate * 3600.0) * 1e6

    # ---- exposition ----------------------------------------------------------------------

    def render(self) -> bytes:
        """The Prometheus text exposition of this worker's registry."""
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve `/metrics` from a daemon thread; port 0 picks a free one. Returns the port."""
        if self._server is not None:
            raise RuntimeError("metrics are already served on port "
                               f"{self._server.server_port}")
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return server.server_port

    def close(self) -> None:
        """Stop the HTTP endpoint `serve` started (no-op otherwise)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
