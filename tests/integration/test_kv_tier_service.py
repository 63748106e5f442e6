"""The host tier of the prefix cache through the worker service and a real Redis (single and
Cluster): its setting reaches the engine, a tenant's prefix evicted from the pool comes back from the tier with the
same answer, and the worker's metrics count the hits by tier and the tier's blocks."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.shared.settings import WorkerSettings
from kvfleet.shared.wire import SamplingParams
from tests.engine.tiny_models import random_prompt
from tests.integration.test_worker_service import client, make_service, run_until, tiny  # noqa: F401 (fixtures)

pytestmark = pytest.mark.topologies

PREFIX = 100  # tokens: 25 blocks of the service's 4-token blocks; four prefixes overflow its 64


def metric(service, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(service.metrics.render().decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no {name} {labels}")


def test_an_evicted_prefix_is_served_from_the_host_tier(redis_url, client, tiny):
    size_gib = 0.001  # ~500 blocks of the tiny model's 2 KB: the whole working set
    assert WorkerSettings(model="tiny", kv_offloading_size=size_gib).engine_config(
        ).kv_offloading_size == size_gib  # the worker's flag is the engine's field
    worker = make_service(redis_url, tiny, "w1", engine_config={"kv_offloading_size": size_gib})
    prefixes = [random_prompt(PREFIX, seed=70 + i) for i in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    answers = {}
    for turn, prefix in enumerate(prefixes + prefixes[:1]):  # the first tenant comes back last
        prompt = prefix + random_prompt(3, seed=80 + turn)
        req_id = client.send(prompt, params)
        run_until(worker, lambda: client.final(req_id))
        final = client.final(req_id)
        answers[turn] = (client.text(req_id), tiny.reference(prompt, 6), final)
    assert all(text == reference for text, reference, _ in answers.values())
    # the first tenant's prefix had left the pool (three others filled it): its 25 blocks came
    # back from the tier
    assert answers[4][2].usage.cached_tokens == PREFIX
    assert metric(worker, "kvfleet_worker_prefix_cache_tier_hit_tokens_total", tier="host") == PREFIX
    assert metric(worker, "kvfleet_worker_prefix_cache_tier_hit_tokens_total", tier="device") == 0
    assert metric(worker, "kvfleet_worker_kv_offload_restored_blocks_total") == 25
    assert metric(worker, "kvfleet_worker_kv_offloaded_blocks_total") >= 25
    assert metric(worker, "kvfleet_worker_kv_offload_evicted_blocks_total") == 0
    capacity = metric(worker, "kvfleet_worker_kv_offload_capacity_bytes")
    assert 0 < metric(worker, "kvfleet_worker_kv_offload_used_bytes") <= capacity
