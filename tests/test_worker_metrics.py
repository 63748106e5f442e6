"""WorkerMetrics: fake engine outputs and stats in, Prometheus exposition out."""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass, field

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.worker.metrics import WorkerMetrics

LABELS = {"model": "tiny", "worker": "w1"}


@dataclass
class FakeOutput:
    req_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class FakeStats:
    num_blocks_total: int = 100
    num_blocks_free: int = 100
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    num_swap_preemptions: int = 0
    swap_used_bytes: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_cached_blocks: int = 0
    num_generated_tokens: int = 0
    num_prefill_tokens_computed: int = 0
    num_constrained: int = 0
    grammar_compiles: int = 0
    grammar_cache_hits: int = 0
    num_cuda_graph_steps: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    prefix_host_hit_tokens: int = 0
    prefix_peer_hit_tokens: int = 0
    prefix_disk_hit_tokens: int = 0
    kv_disk_capacity_bytes: int = 0
    kv_disk_used_bytes: int = 0
    kv_disk_spilled_blocks: int = 0
    kv_disk_evicted_blocks: int = 0
    kv_disk_restored_blocks: int = 0
    kv_offload_capacity_bytes: int = 0
    kv_offload_used_bytes: int = 0
    kv_offloaded_blocks: int = 0
    kv_offload_evicted_blocks: int = 0
    kv_offload_restored_blocks: int = 0
    sim_steps: int = 0
    sim_lagged_steps: int = 0


def test_a_simulated_workers_steps_and_late_steps_are_counted_from_its_cumulative_stats():
    metrics = WorkerMetrics("w1", "tiny", clock=FakeClock())
    metrics.update_stats(FakeStats(sim_steps=40, sim_lagged_steps=1))
    metrics.update_stats(FakeStats(sim_steps=100, sim_lagged_steps=3))
    text = metrics.render().decode()
    assert 'kvfleet_worker_sim_steps_total{model="tiny",worker="w1"} 100.0' in text
    assert 'kvfleet_worker_sim_lagged_steps_total{model="tiny",worker="w1"} 3.0' in text


def test_host_tier_counts_hits_by_tier_and_its_blocks():
    metrics = WorkerMetrics("w1", "tiny", clock=FakeClock())
    metrics.update_stats(FakeStats())
    assert value(metrics, "kvfleet_worker_kv_offload_capacity_bytes") == 0  # off: all zeros
    assert value(metrics, "kvfleet_worker_prefix_cache_tier_hit_tokens_total", tier="host") == 0
    metrics.update_stats(FakeStats(prefix_queried_tokens=100, prefix_hit_tokens=48,
                                   prefix_host_hit_tokens=32, kv_offload_capacity_bytes=1 << 20,
                                   kv_offload_used_bytes=4096, kv_offloaded_blocks=10,
                                   kv_offload_evicted_blocks=2, kv_offload_restored_blocks=8))
    metrics.update_stats(FakeStats(prefix_queried_tokens=150, prefix_hit_tokens=64,
                                   prefix_host_hit_tokens=40, kv_offload_capacity_bytes=1 << 20,
                                   kv_offload_used_bytes=8192, kv_offloaded_blocks=12,
                                   kv_offload_evicted_blocks=3, kv_offload_restored_blocks=10))
    tier_hits = "kvfleet_worker_prefix_cache_tier_hit_tokens_total"
    assert value(metrics, tier_hits, tier="host") == 40
    assert value(metrics, tier_hits, tier="device") == 24
    assert value(metrics, "kvfleet_worker_prefix_cache_hit_tokens_total") == 64
    assert value(metrics, "kvfleet_worker_kv_offloaded_blocks_total") == 12
    assert value(metrics, "kvfleet_worker_kv_offload_evicted_blocks_total") == 3
    assert value(metrics, "kvfleet_worker_kv_offload_restored_blocks_total") == 10
    assert value(metrics, "kvfleet_worker_kv_offload_used_bytes") == 8192
    assert value(metrics, "kvfleet_worker_kv_offload_capacity_bytes") == 1 << 20


def test_peer_hits_are_their_own_tier_and_fetches_count_by_outcome():
    metrics = WorkerMetrics("w1", "tiny", clock=FakeClock())
    tier_hits = "kvfleet_worker_prefix_cache_tier_hit_tokens_total"
    metrics.update_stats(FakeStats(prefix_hit_tokens=96, prefix_host_hit_tokens=16,
                                   prefix_peer_hit_tokens=64))
    assert value(metrics, tier_hits, tier="peer") == 64
    assert value(metrics, tier_hits, tier="host") == 16
    assert value(metrics, tier_hits, tier="device") == 16  # the rest
    fetches = "kvfleet_worker_kv_peer_fetches_total"
    for outcome in ("fetched", "joined", "slower", "failed", "late", "incompatible"):
        assert value(metrics, fetches, outcome=outcome) == 0  # listed before any happens
    metrics.tier.peer_fetch("fetched", 4, 4096, 0.05, saved_s=0.2)
    metrics.tier.peer_fetch("joined")
    metrics.tier.peer_fetch("late")
    metrics.tier.peer_fetch("fetched", 2, 2048, 0.5, saved_s=-0.1)  # slower than estimated
    assert value(metrics, fetches, outcome="fetched") == 2
    assert value(metrics, fetches, outcome="joined") == 1
    assert value(metrics, fetches, outcome="late") == 1
    assert value(metrics, "kvfleet_worker_kv_peer_fetched_blocks_total") == 6
    assert value(metrics, "kvfleet_worker_kv_peer_fetched_bytes_total") == 6144
    assert value(metrics, "kvfleet_worker_kv_peer_fetch_saved_seconds_total") == pytest.approx(0.2)
    assert value(metrics, "kvfleet_worker_kv_peer_fetch_seconds_count") == 2


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def samples(metrics: WorkerMetrics) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} parsed back from the exposition text."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: WorkerMetrics, name: str, **extra: str) -> float:
    return samples(metrics)[(name, tuple(sorted({**LABELS, **extra}.items())))]


def test_counters_and_gauges_follow_steps():
    clock = FakeClock()
    metrics = WorkerMetrics("w1", "tiny", clock=clock)
    metrics.request_started(queue_wait_s=0.3)
    metrics.request_started(queue_wait_s=2.0)
    clock.now += 0.1
    metrics.step_done([FakeOutput("a", [1]), FakeOutput("b", [2])],
                      FakeStats(num_blocks_free=70, num_running=2, num_waiting=1,
                                prefix_queried_tokens=40, prefix_hit_tokens=10,
                                num_cached_blocks=3, num_prefill_tokens_computed=30,
                                num_cuda_graph_steps=3, spec_num_drafts=4,
                                spec_num_draft_tokens=12, spec_num_accepted_tokens=5,
                                spec_accepted_per_position=(3, 2, 0)),
                      step_time_s=0.1)
    clock.now += 0.1
    metrics.step_done([FakeOutput("a", [3], finish_reason="stop"),
                       FakeOutput("b", [], finish_reason="abort")],
                      FakeStats(num_blocks_free=75, num_running=1, num_preemptions=2,
                                num_swap_preemptions=1, swap_used_bytes=4096,
                                prefix_queried_tokens=80, prefix_hit_tokens=40,
                                num_cached_blocks=4, num_prefill_tokens_computed=45,
                                num_constrained=3, grammar_compiles=2, grammar_cache_hits=5,
                                num_cuda_graph_steps=7, spec_num_drafts=6,
                                spec_num_draft_tokens=18, spec_num_accepted_tokens=9,
                                spec_accepted_per_position=(4, 3, 2)),
                      step_time_s=0.03)

    assert value(metrics, "kvfleet_worker_requests_started_total") == 2
    assert value(metrics, "kvfleet_worker_output_tokens_total") == 3
    assert value(metrics, "kvfleet_worker_prompt_tokens_total") == 45
    assert value(metrics, "kvfleet_worker_requests_finished_total", outcome="stop") == 1
    assert value(metrics, "kvfleet_worker_requests_finished_total", outcome="abort") == 1
    assert value(metrics, "kvfleet_worker_preemptions_total") == 2
    assert value(metrics, "kvfleet_worker_preemptions_swapped_total") == 1
    assert value(metrics, "kvfleet_worker_swap_used_bytes") == 4096
    assert value(metrics, "kvfleet_worker_running") == 1
    assert value(metrics, "kvfleet_worker_waiting") == 0
    assert value(metrics, "kvfleet_worker_kv_blocks_total") == 100
    assert value(metrics, "kvfleet_worker_kv_blocks_used") == 25
    assert value(metrics, "kvfleet_worker_kv_usage_ratio") == pytest.approx(0.25)
    assert value(metrics, "kvfleet_worker_prefix_cache_blocks") == 4
    assert value(metrics, "kvfleet_worker_prefix_cache_hit_ratio") == pytest.approx(0.5)
    assert value(metrics, "kvfleet_worker_prefix_cache_queried_tokens_total") == 80
    assert value(metrics, "kvfleet_worker_prefix_cache_hit_tokens_total") == 40
    assert value(metrics, "kvfleet_worker_constrained_requests") == 3
    assert value(metrics, "kvfleet_worker_grammar_compiles_total") == 2
    assert value(metrics, "kvfleet_worker_grammar_cache_hits_total") == 5
    assert value(metrics, "kvfleet_worker_cuda_graph_steps_total") == 7
    assert value(metrics, "kvfleet_worker_spec_decode_num_drafts_total") == 6
    assert value(metrics, "kvfleet_worker_spec_decode_num_draft_tokens_total") == 18
    assert value(metrics, "kvfleet_worker_spec_decode_num_accepted_tokens_total") == 9
    per_pos = "kvfleet_worker_spec_decode_num_accepted_tokens_per_pos_total"
    assert [value(metrics, per_pos, position=str(i)) for i in range(3)] == [4, 3, 2]


def test_histograms_bucket_queue_wait_and_step_time():
    metrics = WorkerMetrics("w1", "tiny", clock=FakeClock())
    metrics.request_started(queue_wait_s=0.3)
    metrics.request_started(queue_wait_s=2.0)
    metrics.request_started(queue_wait_s=None)  # resumed: counted, its wait not observed
    metrics.step_done([], FakeStats(), step_time_s=0.015)
    assert value(metrics, "kvfleet_worker_requests_started_total") == 3
    assert value(metrics, "kvfleet_worker_queue_wait_seconds_count") == 2
    assert value(metrics, "kvfleet_worker_queue_wait_seconds_sum") == pytest.approx(2.3)
    assert value(metrics, "kvfleet_worker_queue_wait_seconds_bucket", le="0.25") == 0
    assert value(metrics, "kvfleet_worker_queue_wait_seconds_bucket", le="0.5") == 1
    assert value(metrics, "kvfleet_worker_queue_wait_seconds_bucket", le="2.5") == 2
    assert value(metrics, "kvfleet_worker_step_duration_seconds_bucket", le="0.01") == 0
    assert value(metrics, "kvfleet_worker_step_duration_seconds_bucket", le="0.02") == 1


def test_cumulative_preemptions_count_deltas_and_survive_an_engine_restart():
    metrics = WorkerMetrics("w1", "tiny", clock=FakeClock())
    for preemptions in (1, 1, 4, 2):  # 2 after 4: a new engine counting from 0 again
        metrics.step_done([], FakeStats(num_preemptions=preemptions), step_time_s=0.01)
    assert value(metrics, "kvfleet_worker_preemptions_total") == 4 + 2


def test_tokens_per_s_is_smoothed_over_the_window_and_decays_when_idle():
    clock = FakeClock()
    metrics = WorkerMetrics("w1", "tiny", cost_per_hour=3.6, rate_window_s=10.0, clock=clock)
    assert metrics.tokens_per_s() == 0.0
    for _ in range(100):  # 10 s of steps, 0.1 s each, 5 tokens each: 50 tokens/s
        clock.now += 0.1
        metrics.step_done([FakeOutput(str(i), [i]) for i in range(5)], FakeStats(),
                          step_time_s=0.1)
    assert value(metrics, "kvfleet_worker_tokens_per_second") == pytest.approx(50.0, rel=0.02)
    # $3.60/h at 50 tokens/s = 180,000 tokens/h -> $20 per 1M output tokens
    assert value(metrics, "kvfleet_worker_cost_per_million_output_tokens_dollars") == \
        pytest.approx(20.0, rel=0.02)
    assert value(metrics, "kvfleet_worker_cost_per_hour_dollars") == 3.6
    clock.now += 11.0  # idle past the window: no steps, the rate reads 0 at scrape time
    assert value(metrics, "kvfleet_worker_tokens_per_second") == 0.0
    assert math.isnan(value(metrics, "kvfleet_worker_cost_per_million_output_tokens_dollars"))


def test_young_worker_rate_divides_by_its_age_not_the_window():
    clock = FakeClock()
    metrics = WorkerMetrics("w1", "tiny", rate_window_s=10.0, clock=clock)
    clock.now += 0.5
    metrics.step_done([FakeOutput("a", [1, 2, 3, 4, 5])], FakeStats(), step_time_s=0.5)
    assert metrics.tokens_per_s() == pytest.approx(10.0)


def test_no_price_no_cost_series():
    metrics = WorkerMetrics("w1", "tiny", clock=FakeClock())
    names = {name for name, _ in samples(metrics)}
    assert "kvfleet_worker_tokens_per_second" in names
    assert not any("cost" in name for name in names)


def test_instances_have_separate_registries():
    first = WorkerMetrics("w1", "tiny", clock=FakeClock())
    WorkerMetrics("w1", "tiny", clock=FakeClock())  # same names: no duplicate-timeseries error
    first.request_started(0.1)
    assert value(first, "kvfleet_worker_requests_started_total") == 1


def test_serve_answers_over_http():
    metrics = WorkerMetrics("w1", "tiny", cost_per_hour=2.5)
    port = metrics.serve(0, host="127.0.0.1")
    try:
        assert port > 0
        metrics.step_done([FakeOutput("a", [7], finish_reason="length")],
                          FakeStats(num_blocks_free=90), step_time_s=0.02)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            text = resp.read().decode()
        assert 'kvfleet_worker_kv_blocks_used{model="tiny",worker="w1"} 10.0' in text
        assert 'outcome="length"' in text
        with pytest.raises(RuntimeError, match="already served"):
            metrics.serve(0)
    finally:
        metrics.close()
