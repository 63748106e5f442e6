"""Prefixes fetched from peers (`--kv-peer-fetch`) between worker services on a real Redis (single
and Cluster) and a real TCP transfer plane, tiny engines stepped in turn: a request whose prompt
opening another worker holds takes those blocks instead of computing them, with the answer it
would have computed; requests sharing the opening share one fetch; a holder of other numerics,
a holder that is gone, a fetch that fails, and the setting off all compute the prefix, with the
same answer and no error."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.shared.wire import SamplingParams
from kvfleet.worker.handoff import peer_prefixes
from tests.engine.tiny_models import random_prompt
from tests.helpers.channels import cancel
from tests.integration.test_worker_service import MODEL
from tests.integration.test_handoff_service import (  # noqa: F401 (fixtures)
    client, service, step_all, tiny, workers)

pytestmark = pytest.mark.topologies

PREFIX = 64  # tokens: 16 of the services' 4-token blocks
PARAMS = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)


@pytest.fixture(autouse=True)
def fetch_pays(monkeypatch):
    """A tiny model computes a prefix in about a millisecond, which no fetch beats (the
    estimate rightly says so: test_a_fetch_estimated_slower_is_not_made): here the wire is
    free, so that the estimate takes the fetch."""
    monkeypatch.setattr(peer_prefixes, "FETCH_OVERHEAD_S", 0.0)
    monkeypatch.setattr(peer_prefixes, "DEFAULT_WIRE_RATE", 1e15)


def svc(redis_url, tiny, worker_id: str, **settings):
    """A worker of the tiny model (4-token blocks) that fetches from 16 prompt tokens on."""
    return service(redis_url, tiny, worker_id, **{"kv_peer_fetch_min_tokens": 16, **settings})


def metric(worker, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(worker.metrics.render().decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def send_to(client, worker_id: str, prompt: list[int]) -> str:
    """A request routed to `worker_id`'s own stream, as the router sends one there when load
    wins over affinity (the holder is busy): the worker holds none of its prompt."""
    return client.send(prompt, PARAMS, worker_id=worker_id)


def computed(worker) -> float:
    return metric(worker, "kvfleet_worker_prompt_tokens_total")


def warm(client, holder, prefix: list[int]) -> None:
    """The holder serves one request with the prefix; its blocks are announced."""
    first = send_to(client, holder.protocol.worker_id, prefix + random_prompt(5, seed=1))
    step_all(workers(holder), lambda: client.final(first))


def reference(redis_url, tiny, client, prompts: list[list[int]]) -> list[list[int]]:
    ref = service(redis_url, tiny, "ref", handoffs=False)
    ids = [send_to(client, "ref", p) for p in prompts]
    step_all(workers(ref), lambda: all(client.final(r) for r in ids))
    return [client.text(r) for r in ids]


def test_a_prefix_another_worker_holds_is_fetched_not_computed(redis_url, client, tiny):
    prefix = random_prompt(PREFIX, seed=10)
    prompts = [prefix + random_prompt(6, seed=20 + i) for i in range(3)]
    expected = reference(redis_url, tiny, client, prompts)
    holder, asker = svc(redis_url, tiny, "holder"), svc(redis_url, tiny, "asker")
    warm(client, holder, prefix)
    before = computed(asker)
    # three requests sharing the prefix arrive at the asker together: one fetch for all
    ids = [send_to(client, "asker", p) for p in prompts]
    step_all(workers(holder, asker), lambda: all(client.final(r) for r in ids))
    assert [client.text(r) for r in ids] == expected  # seeded sampling: the same tokens
    assert [client.final(r).usage.cached_tokens for r in ids] == [PREFIX] * 3
    # the asker computed only the tails (and the tokens after the fetched blocks)
    assert computed(asker) - before == sum(len(p) - PREFIX for p in prompts)
    assert metric(asker, "kvfleet_worker_kv_peer_fetches_total", outcome="fetched") == 1
    assert metric(asker, "kvfleet_worker_kv_peer_fetches_total", outcome="joined") == 2
    assert metric(asker, "kvfleet_worker_kv_peer_fetched_blocks_total") == PREFIX // 4
    assert metric(asker, "kvfleet_worker_kv_peer_fetched_bytes_total") == (
        PREFIX // 4 * asker.engine.pool.block_bytes)
    assert metric(asker, "kvfleet_worker_prefix_cache_tier_hit_tokens_total",
                  tier="peer") == PREFIX  # the first request took the blocks; the others hit
    assert metric(holder, "kvfleet_worker_kv_peer_served_blocks_total") == PREFIX // 4
    # the asker now announces the prefix: the router sees two holders
    keys = client.keys
    assert client.redis.scard(keys.kv_blocks(MODEL, "asker")) >= PREFIX // 4


def test_without_the_setting_the_prefix_is_computed(redis_url, client, tiny):
    prefix = random_prompt(PREFIX, seed=11)
    prompt = prefix + random_prompt(6, seed=30)
    expected = reference(redis_url, tiny, client, [prompt])
    holder = svc(redis_url, tiny, "holder")
    asker = svc(redis_url, tiny, "asker", kv_peer_fetch=False)
    warm(client, holder, prefix)
    before = computed(asker)
    req_id = send_to(client, "asker", prompt)
    step_all(workers(holder, asker), lambda: client.final(req_id))
    assert client.text(req_id) == expected[0]
    assert client.final(req_id).usage.cached_tokens == 0
    assert computed(asker) - before == len(prompt)  # the control: every token computed
    assert metric(holder, "kvfleet_worker_kv_peer_served_blocks_total") == 0


def test_a_fetch_estimated_slower_is_not_made(redis_url, client, tiny, monkeypatch):
    prefix = random_prompt(PREFIX, seed=15)
    holder, asker = svc(redis_url, tiny, "holder"), svc(redis_url, tiny, "asker")
    warm(client, holder, prefix)
    # the asker's curve fitted from its own steps; the wire as slow as a modem
    req_id = send_to(client, "asker", random_prompt(40, seed=34))
    step_all(workers(asker), lambda: client.final(req_id))
    assert asker.peers._prefill_seconds(PREFIX, 0) is not None
    monkeypatch.setattr(peer_prefixes, "DEFAULT_WIRE_RATE", 1e3)
    req_id = send_to(client, "asker", prefix + random_prompt(6, seed=35))
    step_all(workers(holder, asker), lambda: client.final(req_id))
    assert client.final(req_id).usage.cached_tokens == 0
    assert metric(asker, "kvfleet_worker_kv_peer_fetches_total", outcome="slower") == 1
    assert metric(holder, "kvfleet_worker_kv_peer_served_blocks_total") == 0


def test_a_holder_of_other_numerics_is_not_asked(redis_url, client, tiny):
    prefix = random_prompt(PREFIX, seed=12)
    prompt = prefix + random_prompt(6, seed=31)
    holder = svc(redis_url, tiny, "holder", numerics="other-cpu")
    asker = svc(redis_url, tiny, "asker", numerics="this-cpu")
    warm(client, holder, prefix)
    req_id = send_to(client, "asker", prompt)
    step_all(workers(holder, asker), lambda: client.final(req_id))
    assert client.final(req_id).usage.cached_tokens == 0
    assert metric(holder, "kvfleet_worker_kv_peer_served_blocks_total") == 0


@pytest.mark.parametrize("failure", ["plane_closed", "holder_stopped"])
def test_a_failed_fetch_computes_the_prefix_with_the_same_answer(redis_url, client, tiny,
                                                                 failure):
    prefix = random_prompt(PREFIX, seed=13)
    prompt = prefix + random_prompt(6, seed=32)
    expected = reference(redis_url, tiny, client, [prompt])
    holder, asker = svc(redis_url, tiny, "holder"), svc(redis_url, tiny, "asker")
    warm(client, holder, prefix)
    fleet = workers(holder, asker)
    if failure == "plane_closed":  # its announcements and heartbeat stay: the fetch fails
        holder.handoffs.plane.close()
    else:  # its loop stops (not stepped): nothing answers the ask, the fetch is late
        fleet = workers(asker)
    before = computed(asker)
    req_id = send_to(client, "asker", prompt)
    step_all(fleet, lambda: client.final(req_id))
    assert client.text(req_id) == expected[0]
    assert client.final(req_id).usage.cached_tokens == 0
    assert computed(asker) - before == len(prompt)
    assert metric(asker, "kvfleet_worker_kv_peer_fetches_total", outcome="fetched") == 0
    assert metric(asker, "kvfleet_worker_kv_peer_fetches_total", outcome="failed") + metric(
        asker, "kvfleet_worker_kv_peer_fetches_total", outcome="late") == 1


def test_a_cancel_while_the_prefix_is_fetched_ends_the_request(redis_url, client, tiny):
    prefix = random_prompt(PREFIX, seed=14)
    holder, asker = svc(redis_url, tiny, "holder"), svc(redis_url, tiny, "asker")
    warm(client, holder, prefix)
    req_id = send_to(client, "asker", prefix + random_prompt(6, seed=33))
    # the asker admits it and starts the fetch; the holder never answers (not stepped)
    step_all(workers(asker), lambda: asker.peers.num_waiting == 1)
    cancel(client.redis, client.keys, req_id)
    step_all(workers(asker), lambda: client.final(req_id))
    assert client.final(req_id).finish_reason == "abort"
    assert asker.peers.num_waiting == 0
    assert not asker.engine.has_unfinished()


def test_the_live_announcers_are_read_once_a_refresh_and_none_is_asked_alone(redis_url,
                                                                              client, tiny):
    asker = svc(redis_url, tiny, "asker")
    holders = asker.peers.holders
    reads = []
    real = holders.client.zrangebyscore
    holders.client.zrangebyscore = lambda *a, **k: reads.append(a) or real(*a, **k)
    holders.refresh_s = 60.0
    holders._read_at = -1e9
    hashes = [bytes(16)] * 4
    assert holders(hashes, 0) == [] and holders(hashes, 0) == []  # alone: nobody to ask
    assert len(reads) == 1  # the list read once for both lookups
    holder = svc(redis_url, tiny, "holder")
    warm(client, holder, random_prompt(PREFIX, seed=16))
    assert holders.others() == []  # not read again before the refresh
    holders._read_at = -1e9  # the refresh is due
    assert holders.others() == ["holder"]
    assert len(reads) == 2
