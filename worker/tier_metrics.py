"""Prometheus metrics of a worker's host tier of the prefix cache (`--kv-offloading-size`,
worker/engine/tiers/offloading.py), on the worker's registry (metrics.py `WorkerMetrics.tier`): hits by
tier, blocks offloaded, dropped from the tier and brought back, the tier's bytes. All zeros while
the tier is off."""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge


class TierStats(Protocol):
    """What these metrics read of `worker.engine.reports.EngineStats` (counts are cumulative)."""

    prefix_hit_tokens: int
    prefix_host_hit_tokens: int
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
            "tier: device (in the KV pool) or host (brought back from the host tier, "
            "--kv-offloading-size); their sum is prefix_cache_hit_tokens.",
            label_names + ("tier",), registry=registry)
        self._device_hits, self._host_hits = delta(), delta()

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

    def update(self, stats: TierStats) -> None:
        host = stats.prefix_host_hit_tokens
        self._hits.labels(**self._labels, tier="device").inc(
            self._device_hits.step(stats.prefix_hit_tokens - host))
        self._hits.labels(**self._labels, tier="host").inc(self._host_hits.step(host))
        self.offloaded.inc(self._offloaded.step(stats.kv_offloaded_blocks))
        self.evicted.inc(self._evicted.step(stats.kv_offload_evicted_blocks))
        self.restored.inc(self._restored.step(stats.kv_offload_restored_blocks))
        self.used.set(stats.kv_offload_used_bytes)
        self.capacity.set(stats.kv_offload_capacity_bytes)
