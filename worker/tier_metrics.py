"""Prometheus metrics of a worker's tiers of the prefix cache beyond its KV pool, on the worker's
registry (metrics.py `WorkerMetrics.tier`): hits by tier (device, host, disk, peer); the host
tier's blocks offloaded, dropped and brought back and its bytes (`--kv-offloading-size`,
worker/engine/tiers/offloading.py; zeros while off), the disk tier's likewise
(`--kv-offloading-disk`); and prefixes fetched from peers (`--kv-peer-fetch`,
worker/handoff/peer_prefixes.py): decisions by outcome, blocks and bytes, time taken and the
prefill time they saved, blocks served to peers."""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# what a prefix that another worker holds came to (worker/handoff/peer_prefixes.py): fetched; joined a
# fetch of the same prefix in progress; recomputed because the estimate said so (slower), the
# fetch failed or was refused, came too late, or brought blocks of another layout
PEER_OUTCOMES = ("fetched", "joined", "slower", "failed", "late", "incompatible")


class TierStats(Protocol):
    """What these metrics read of `worker.engine.reports.EngineStats` (counts are cumulative)."""

    prefix_hit_tokens: int
    prefix_host_hit_tokens: int
    prefix_peer_hit_tokens: int
    prefix_disk_hit_tokens: int
    kv_disk_capacity_bytes: int
    kv_disk_used_bytes: int
    kv_disk_spilled_blocks: int
    kv_disk_evicted_blocks: int
    kv_disk_restored_blocks: int
    kv_offload_capacity_bytes: int
    kv_offload_used_bytes: int
    kv_offloaded_blocks: int
    kv_offload_evicted_blocks: int
    kv_offload_restored_blocks: int


class TierMetrics:
    """The tier's counters and gauges, labelled like the worker's other series."""

    def __init__(self, registry: CollectorRegistry, label_names: tuple[str, ...],
                 labels: dict[str, str], delta):
        p = "kvfleet_worker_"
        self._labels = labels
        self._hits = Counter(
            p + "prefix_cache_tier_hit_tokens", "Prompt tokens found in the prefix cache, by "
            "tier: device (in the KV pool), host (brought back from the host tier, "
            "--kv-offloading-size), disk (from the disk tier behind it, --kv-offloading-disk) or "
            "peer (fetched from another worker, --kv-peer-fetch); their sum is "
            "prefix_cache_hit_tokens.",
            label_names + ("tier",), registry=registry)
        self._device_hits, self._host_hits, self._peer_hits = delta(), delta(), delta()
        self._disk_hits = delta()

        def counter(name: str, doc: str) -> Counter:
            return Counter(p + name, doc, label_names, registry=registry).labels(**labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(p + name, doc, label_names, registry=registry).labels(**labels)

        self.offloaded = counter("kv_offloaded_blocks", "Prefix-cache blocks evicted from the KV "
                                 "pool and copied to the host tier.")
        self.evicted = counter("kv_offload_evicted_blocks", "Blocks dropped from the full host "
                               "tier (least recently used) to make room for newer ones.")
        self.restored = counter("kv_offload_restored_blocks", "Blocks copied back from the host "
                                "tier into the KV pool for a request's prefix.")
        self.used = gauge("kv_offload_used_bytes", "Bytes of the blocks the host tier holds.")
        self.capacity = gauge("kv_offload_capacity_bytes", "The host tier's size "
                              "(--kv-offloading-size; 0: off).")
        self._offloaded, self._evicted, self._restored = delta(), delta(), delta()
        self.disk_spilled = counter("kv_disk_spilled_blocks", "Blocks the host tier dropped for "
                                    "room and the disk tier kept (--kv-offloading-disk).")
        self.disk_evicted = counter("kv_disk_evicted_blocks", "Blocks dropped from the full disk "
                                    "tier (least recently used).")
        self.disk_restored = counter("kv_disk_restored_blocks", "Blocks read from the disk tier "
                                     "back into the KV pool for a request's prefix.")
        self.disk_used = gauge("kv_disk_used_bytes", "Bytes of the blocks the disk tier holds.")
        self.disk_capacity = gauge("kv_disk_capacity_bytes", "The disk tier's size "
                                   "(--kv-offloading-disk-size; 0: off).")
        self._spilled, self._disk_evicted, self._disk_restored = delta(), delta(), delta()
        self._fetches = Counter(
            p + "kv_peer_fetches", "Admitted requests whose prompt opening another live worker "
            "held beyond this one's cache, by outcome: fetched, joined (a fetch of it in "
            "progress), slower (recomputed: fetching was estimated slower), failed, late, "
            "incompatible (recomputed after trying).", label_names + ("outcome",),
            registry=registry)
        for outcome in PEER_OUTCOMES:
            self._fetches.labels(**labels, outcome=outcome)
        self.fetched_blocks = counter("kv_peer_fetched_blocks", "KV blocks fetched from peers "
                                      "and installed in this worker's prefix cache.")
        self.fetched_bytes = counter("kv_peer_fetched_bytes", "KV bytes fetched from peers.")
        self.saved_seconds = counter("kv_peer_fetch_saved_seconds", "Prefill seconds the "
                                     "fetches saved: the estimated time to compute their blocks "
                                     "less the time the fetches took.")
        self.served_blocks = counter("kv_peer_served_blocks", "KV blocks this worker sent to "
                                     "peers that asked for a prefix.")
        self.fetch_time = Histogram(
            p + "kv_peer_fetch_seconds", "Time from deciding to fetch a prefix to its blocks in "
            "the prefix cache.", label_names, registry=registry,
            buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)).labels(**labels)

    def peer_fetch(self, outcome: str, num_blocks: int = 0, num_bytes: int = 0,
                   seconds: float | None = None, saved_s: float = 0.0) -> None:
        self._fetches.labels(**self._labels, outcome=outcome).inc()
        if outcome == "fetched":
            self.fetched_blocks.inc(num_blocks)
            self.fetched_bytes.inc(num_bytes)
            self.saved_seconds.inc(max(0.0, saved_s))
            if seconds is not None:
                self.fetch_time.observe(seconds)

    def update(self, stats: TierStats) -> None:
        host, peer = stats.prefix_host_hit_tokens, stats.prefix_peer_hit_tokens
        disk = stats.prefix_disk_hit_tokens  # within the host tier's hits
        self._hits.labels(**self._labels, tier="device").inc(
            self._device_hits.step(stats.prefix_hit_tokens - host - peer))
        self._hits.labels(**self._labels, tier="host").inc(self._host_hits.step(host - disk))
        self._hits.labels(**self._labels, tier="disk").inc(self._disk_hits.step(disk))
        self._hits.labels(**self._labels, tier="peer").inc(self._peer_hits.step(peer))
        self.offloaded.inc(self._offloaded.step(stats.kv_offloaded_blocks))
        self.evicted.inc(self._evicted.step(stats.kv_offload_evicted_blocks))
        self.restored.inc(self._restored.step(stats.kv_offload_restored_blocks))
        self.used.set(stats.kv_offload_used_bytes)
        self.capacity.set(stats.kv_offload_capacity_bytes)
        self.disk_spilled.inc(self._spilled.step(stats.kv_disk_spilled_blocks))
        self.disk_evicted.inc(self._disk_evicted.step(stats.kv_disk_evicted_blocks))
        self.disk_restored.inc(self._disk_restored.step(stats.kv_disk_restored_blocks))
        self.disk_used.set(stats.kv_disk_used_bytes)
        self.disk_capacity.set(stats.kv_disk_capacity_bytes)
