"""The promised pace in the worker service, on a real Redis: a worker takes only the streams it
serves at its pace and leaves the rest in the queue for another worker; its heartbeat and
metrics carry the pace promised and kept; a batch request gets --batch-target-itl-ms."""

from __future__ import annotations

import time

import pytest

from kvfleet.shared.pace import StepCostCurve, StepFeatures
from kvfleet.shared.redis_connect import is_cluster
from kvfleet.shared.wire import GenerationRequest, Heartbeat, RequestRecord, SamplingParams, scripts
from tests.engine.tiny_models import random_prompt
from tests.helpers.channels import subscribe
from tests.integration.test_worker_service import (  # noqa: F401  (fixtures)
    MODEL, Client, client, make_service, run_until, tiny)
from kvfleet.worker.engine.core.pace import StepCostModel

pytestmark = pytest.mark.topologies


def slow_fit(engine) -> None:
    """Pretend each decode row costs 10 ms on top of 10 ms a step (the tiny model's real steps
    take about 1 ms), and stop refitting: at a 40 ms target the worker runs two streams."""
    model = StepCostModel()
    for rows in range(0, 65):
        work = StepFeatures(rows, rows * 60, 0 if rows else 64)
        model.observe(work, 0.010 + 0.010 * rows)
    pace = engine.pace
    pace.model = model
    pace.margin.value, pace.overhead_s = 1.0, 0.0
    pace.observe = lambda *args: None  # the fit made by hand stays


def test_a_worker_at_its_pace_leaves_the_rest_in_the_queue(redis_url, client, tiny):
    paced = make_service(redis_url, tiny, "paced", engine_config={"target_itl_ms": 40.0})
    slow_fit(paced.engine)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = [random_prompt(12, seed=40 + i) for i in range(6)]
    ids = [client.send(p, params) for p in prompts]
    for _ in range(30):
        paced.run_once()
        paced._beat()
        assert len(paced.inflight) <= 2
    assert len(paced.inflight) == 2
    streams = [s for s in client.keys.all_queues(MODEL) if client.redis.exists(s)]
    undelivered = sum(client.redis.xlen(s) - client.redis.xinfo_groups(s)[0]["pending"]
                      for s in streams)  # nothing acknowledged yet
    assert undelivered == 4  # any worker with room takes them
    paced._snapshot_stats()
    paced._beat()
    beat = Heartbeat.decode(client.redis.hgetall(client.keys.worker("paced")))
    assert beat.target_itl_ms == 40.0 and beat.pace_room == 0 and beat.pace_streams == 2
    assert StepCostCurve.from_json(beat.step_cost).decode_row_s == pytest.approx(0.010, rel=0.05)

    other = make_service(redis_url, tiny, "other")  # no target: takes what fits its pool
    other_beat_room = None
    for _ in range(3000):
        if all(client.final(r) for r in ids):
            break
        for service in (paced, other):  # in-process: the loop beats (heartbeats last 0.3 s)
            service.run_once()
            service._beat()
        if other_beat_room is None:
            other_beat_room = Heartbeat.decode(
                client.redis.hgetall(client.keys.worker("other"))).pace_room
    assert all(client.final(r) for r in ids)
    assert other_beat_room == -1  # no pace promised
    for req_id, prompt in zip(ids, prompts):
        assert client.text(req_id) == tiny.reference(prompt, 20)
    served_by_paced = paced.metrics.requests_started._value.get()
    assert 2 <= served_by_paced < 6


def enqueue(client: Client, request: GenerationRequest) -> str:
    """Client.send for a request made by hand (its priority, its enqueue time)."""
    channel = client.keys.tokens(request.req_id)
    if client.pubsub is None:
        client.pubsub = subscribe(client.redis, channel)
    elif is_cluster(client.redis):
        client.pubsub.ssubscribe(channel)
    else:
        client.pubsub.subscribe(channel)
    client.events[request.req_id] = []
    client.redis.hset(client.keys.request(request.req_id), mapping=RequestRecord(request).encode())
    client.redis.xadd(*scripts.queue_entry(client.keys, request))
    return request.req_id


def test_heartbeat_and_metrics_show_the_pace_kept(redis_url, client, tiny):
    worker = make_service(redis_url, tiny, "w1",
                          engine_config={"target_itl_ms": 2000.0, "target_ttft_ms": 5000.0})
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ids = [client.send(random_prompt(9, seed=60 + i), params) for i in range(2)]
    ids.append(enqueue(client, GenerationRequest("timed", MODEL, random_prompt(9, seed=62),
                                                 params, created=time.time() - 0.2)))
    run_until(worker, lambda: all(client.final(r) for r in ids))
    worker._snapshot_stats()
    worker._beat()
    beat = Heartbeat.decode(client.redis.hgetall(client.keys.worker("w1")))
    assert beat.target_itl_ms == 2000.0 and beat.target_ttft_ms == 5000.0
    assert 0 < beat.itl_p99_ms < 2000 and beat.ttft_p99_ms >= 200  # only "timed" has a time
    assert beat.pace_room >= 1 and StepCostCurve.from_json(beat.step_cost).fitted
    text = worker.metrics.render().decode()
    labels = '{model="tiny",worker="w1"}'
    assert f"kvfleet_worker_itl_seconds_count{labels} 45.0" in text  # 3 x 15 gaps
    assert f"kvfleet_worker_ttft_seconds_count{labels} 1.0" in text
    assert f"kvfleet_worker_target_itl_seconds{labels} 2.0" in text
    assert f"kvfleet_worker_itl_over_target_total{labels} 0.0" in text


def test_a_batch_request_gets_the_batch_pace(redis_url, client, tiny):
    worker = make_service(redis_url, tiny, "w1", batch_target_itl_ms=300.0,
                          engine_config={"target_itl_ms": 50.0})
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    batch = GenerationRequest("batch-1", MODEL, random_prompt(8, seed=70), params,
                              priority="batch")
    enqueue(client, batch)
    own = client.send(random_prompt(8, seed=71), SamplingParams(
        max_tokens=30, temperature=0, ignore_eos=True, target_itl_ms=0))
    run_until(worker, lambda: len(worker.engine.scheduler.running) == 2)
    targets = {s.req_id: worker.engine.pace.target_of(s.params)
               for s in worker.engine.scheduler.running}
    assert targets == {"batch-1": pytest.approx(0.300), own: None}
