"""The worker service loop on a tiny engine and a real Redis (and a real Redis Cluster, with 3
stream shards): serving, crash-resume with fencing, cancellation, deadlines, poison requests and
pull-only-when-room."""

from __future__ import annotations

import time
import uuid

import pytest
import redis

from kvfleet.shared.settings import WorkerSettings
from kvfleet.shared.wire import (
    GenerationRequest,
    Keys,
    RequestRecord,
    SamplingParams,
    TokenEvent,
    decode_checkpoint,
    scripts,
)
from kvfleet.shared.redis_connect import connect, is_cluster
from tests.helpers.channels import cancel, fleet_keys, next_message, request_id_of, subscribe
from tests.engine.tiny_models import TinyModel, random_prompt
from kvfleet.worker.protocol import WorkerProtocol
from kvfleet.worker.process.service import WorkerService

pytestmark = pytest.mark.topologies

MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny() -> TinyModel:
    return TinyModel("llama")


class Client:
    """What a gateway does, reduced to the protocol: enqueue, listen, dedupe by seq/attempt."""

    def __init__(self, redis_client: redis.Redis, keys: Keys):
        self.redis = redis_client
        self.keys = keys
        self.pubsub = None
        self.events: dict[str, list[TokenEvent]] = {}

    def send(self, prompt, params: SamplingParams, deadline: float | None = None,
             req_id: str | None = None, created: float = 0.0, traceparent: str = "",
             worker_id: str = "") -> str:
        """Enqueue on the model's shared streams, or on `worker_id`'s own stream as the router
        sends a request there (with no cached tokens expected)."""
        req_id = req_id or f"r-{uuid.uuid4().hex[:8]}"
        if self.pubsub is None:
            self.pubsub = subscribe(self.redis, self.keys.tokens(req_id))
        elif is_cluster(self.redis):
            self.pubsub.ssubscribe(self.keys.tokens(req_id))
        else:
            self.pubsub.subscribe(self.keys.tokens(req_id))
        request = GenerationRequest(req_id, MODEL, prompt, params, deadline=deadline,
                                    created=created, traceparent=traceparent)
        self.redis.hset(self.keys.request(req_id), mapping=RequestRecord(request).encode())
        stream, fields = scripts.queue_entry(self.keys, request, worker_id)
        self.redis.xadd(stream, fields)
        self.events[req_id] = []
        return req_id

    def drain(self) -> None:
        while (message := next_message(self.pubsub, 0.01)) is not None:
            req_id = request_id_of(message["channel"])
            self.events[req_id].append(TokenEvent.unpack(message["data"]))

    def final(self, req_id: str) -> TokenEvent | None:
        self.drain()
        return next((e for e in self.events[req_id] if e.is_final), None)

    def text(self, req_id: str) -> list[int]:
        """Tokens as a client sees them: stale attempts dropped, repeats dropped, gaps fail."""
        tokens: list[int] = []
        attempt = 0
        for event in self.events[req_id]:
            if event.attempt < attempt:
                continue
            attempt = event.attempt
            for i, token in enumerate(event.token_ids):
                index = event.seq + i
                assert index <= len(tokens), f"gap before token {index}"
                if index == len(tokens):
                    tokens.append(token)
        return tokens


def make_service(redis_url: str, tiny: TinyModel, worker_id: str, **settings) -> WorkerService:
    settings_tokenizer = settings.pop("tokenizer", None)
    engine_config = settings.pop("engine_config", {})
    tracer_provider = settings.pop("tracer_provider", None)
    settings = WorkerSettings(redis_url=redis_url, model=MODEL, worker_id=worker_id,
                              heartbeat_ttl_s=settings.pop("heartbeat_ttl_s", 0.3),
                              heartbeat_interval_s=0.05, read_block_ms=10, **settings)
    client = connect(redis_url)
    protocol = WorkerProtocol(client, fleet_keys(client), MODEL, worker_id, result_ttl_s=60,
                              steal_after_ms=settings.steal_after_ms)
    engine = tiny.engine(tokenizer=settings_tokenizer, num_blocks=64, block_size=4, **engine_config)
    service = WorkerService(settings, engine, client, protocol, tracer_provider=tracer_provider)
    service.connect()
    return service


def run_until(service: WorkerService, done, max_iterations: int = 2000) -> None:
    for _ in range(max_iterations):
        if done():
            return
        service.run_once()
    raise AssertionError("condition not reached")


@pytest.fixture
def client(redis_client) -> Client:
    return Client(redis_client, fleet_keys(redis_client))


def test_serves_a_request_token_for_token_like_generate(redis_url, client, tiny):
    worker = make_service(redis_url, tiny, "w1")
    prompt = random_prompt(11, seed=1)
    req_id = client.send(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    run_until(worker, lambda: client.final(req_id))
    final = client.final(req_id)
    assert final.finish_reason == "length" and final.usage.completion_tokens == 12
    assert client.text(req_id) == tiny.reference(prompt, 12)
    assert decode_checkpoint(client.redis.get(client.keys.checkpoint(req_id))) == tiny.reference(prompt, 12)
    assert all(client.redis.xpending(stream, client.keys.group)["pending"] == 0
               for stream in client.keys.all_queues(MODEL))
    text = worker.metrics.render().decode()
    assert 'kvfleet_worker_output_tokens_total{model="tiny",worker="w1"} 12.0' in text
    assert 'outcome="length"' in text
    # the default --deterministic on kernels that allow it: batch-invariant; off: not
    assert 'kvfleet_worker_batch_invariant{model="tiny",worker="w1"} 1.0' in text
    other = make_service(redis_url, tiny, "w2", engine_config={"deterministic": False})
    assert ('kvfleet_worker_batch_invariant{model="tiny",worker="w2"} 0.0'
            in other.metrics.render().decode())


class NumberTokenizer:
    """Token t decodes to "t," (enough text for stop strings on the tiny model)."""

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(f"{t}," for t in token_ids)


def test_the_final_event_says_what_stopped_the_request(redis_url, client, tiny):
    worker = make_service(redis_url, tiny, "w1", tokenizer=NumberTokenizer())
    prompt = random_prompt(11, seed=1)
    tokens = tiny.reference(prompt, 12)
    at = next(i for i in range(1, 12) if tokens[i] not in tokens[:i])
    by_id = client.send(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                               stop_token_ids=[tokens[at]]))
    stop = f"{tokens[at - 1]},{tokens[at]}"
    by_string = client.send(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                   stop=[stop]))
    run_until(worker, lambda: client.final(by_id) and client.final(by_string))
    final = client.final(by_id)
    assert (final.finish_reason, final.stop_reason) == ("stop", tokens[at])
    assert final.text_after_stop == 0
    assert client.text(by_id) == tokens[:at + 1]
    # the first output the stop string occurs in, and the text after it
    end = next(n for n in range(1, 13) if stop in NumberTokenizer().decode(tokens[:n]))
    text = NumberTokenizer().decode(tokens[:end])
    final = client.final(by_string)
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert final.text_after_stop == len(text) - text.index(stop) - len(stop)
    assert client.text(by_string) == tokens[:end]


def test_an_idle_worker_serves_a_request_of_another_workers_home_shard_at_once(redis_url,
                                                                              client, tiny):
    """Home shards (several stream shards: the cluster here) only order a busy worker's reads:
    an idle worker takes a request from any shard without waiting --steal-after-ms."""
    idle = make_service(redis_url, tiny, "w-idle", steal_after_ms=60_000)
    other = make_service(redis_url, tiny, "w-other", steal_after_ms=60_000)
    idle._beat()  # both on the roster: the first to join gets shards 0 and 2, the other 1
    keys = client.keys
    foreign = [s for s in range(keys.queue_shards) if s not in idle.protocol.home_shards]
    assert foreign == ([1] if idle.protocol.uses_homes else [])
    assert other.protocol.home_shards == ((1,) if idle.protocol.uses_homes else (0,))
    shard = foreign[0] if foreign else 0
    req_id = next(r for r in (f"r-{i}" for i in range(1000)) if keys.shard_of(r) == shard)
    prompt = random_prompt(5, seed=3)
    client.send(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                req_id=req_id)
    started = time.monotonic()
    run_until(idle, lambda: client.final(req_id), max_iterations=50)
    assert time.monotonic() - started < 30  # not held back the 60 s a busy worker waits
    assert client.text(req_id) == tiny.reference(prompt, 4)
    stolen = 'kvfleet_worker_requests_stolen_total{model="tiny",worker="w-idle"} '
    assert stolen + ("1.0" if foreign else "0.0") in idle.metrics.render().decode()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_dead_workers_request_resumes_elsewhere_without_gap_or_repeat(redis_url, client, tiny,
                                                                        temperature):
    prompt = random_prompt(9, seed=2)
    params = SamplingParams(max_tokens=20, temperature=temperature, seed=7, ignore_eos=True)
    reference_worker = make_service(redis_url, tiny, "ref")
    ref_id = client.send(prompt, params)
    run_until(reference_worker, lambda: client.final(ref_id))
    expected = client.text(ref_id)

    dying = make_service(redis_url, tiny, "dying")
    req_id = client.send(prompt, params)
    run_until(dying, lambda: (client.drain(), len(client.text(req_id)) >= 6)[1])
    # `dying` stops here without a word: no heartbeat, its stream entry goes idle.
    time.sleep(0.4)
    rescuer = make_service(redis_url, tiny, "rescuer")
    run_until(rescuer, lambda: client.final(req_id))
    assert client.text(req_id) == expected
    assert max(e.attempt for e in client.events[req_id]) == 2
    assert client.redis.hget(client.keys.request(req_id), "worker") == b"rescuer"
    assert 'kvfleet_worker_takeovers_total{model="tiny",worker="rescuer"} 1.0' in \
        rescuer.metrics.render().decode()

    # The old worker wakes up: its next publish is fenced off and it drops the request.
    start_free = dying.engine.stats().num_blocks_total
    dying.run_once()
    dying.run_once()
    assert req_id not in dying.inflight
    assert not dying.engine.has_unfinished()
    assert dying.engine.stats().num_blocks_free == start_free
    assert client.text(req_id) == expected


def test_coalesced_events_carry_the_same_text_and_held_tokens_survive_a_dead_worker(
        redis_url, client, tiny):
    """--publish-interval-ms: the first token goes out at once, the rest in fewer events with the
    same text; a worker that dies holding tokens loses none (the rescuer regenerates them)."""
    prompt = random_prompt(9, seed=4)
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=11, ignore_eos=True)
    plain = make_service(redis_url, tiny, "plain")
    ref_id = client.send(prompt, params)
    run_until(plain, lambda: client.final(ref_id))
    expected = client.text(ref_id)
    assert len(client.events[ref_id]) == 16  # one event a step

    coalescing = make_service(redis_url, tiny, "coalescing", publish_interval_ms=60_000)
    req_id = client.send(prompt, params)
    run_until(coalescing, lambda: client.final(req_id))
    assert client.text(req_id) == expected
    assert [len(e.token_ids) for e in client.events[req_id]] == [1, 15]  # first, then the rest
    assert decode_checkpoint(client.redis.get(client.keys.checkpoint(req_id))) == expected
    text = coalescing.metrics.render().decode()
    assert 'kvfleet_worker_token_events_total{model="tiny",worker="coalescing"} 2.0' in text
    assert 'kvfleet_worker_output_tokens_total{model="tiny",worker="coalescing"} 16.0' in text

    dying = make_service(redis_url, tiny, "dying", publish_interval_ms=60_000)
    req_id = client.send(prompt, params)
    run_until(dying, lambda: dying.engine.stats().num_generated_tokens >= 8)
    client.drain()
    assert client.text(req_id) == expected[:1] and dying.coalescer.num_held == 1
    assert decode_checkpoint(client.redis.get(client.keys.checkpoint(req_id))) == expected[:1]
    # `dying` stops holding 7 unpublished tokens; its entry goes idle
    time.sleep(0.4)
    rescuer = make_service(redis_url, tiny, "rescuer")
    run_until(rescuer, lambda: client.final(req_id))
    assert client.text(req_id) == expected
    assert max(e.attempt for e in client.events[req_id]) == 2


def test_cancel_aborts_within_a_step_and_frees_blocks(redis_url, client, tiny):
    worker = make_service(redis_url, tiny, "w1")
    start_free = worker.engine.stats().num_blocks_free
    req_id = client.send(random_prompt(8, seed=3),
                         SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    run_until(worker, lambda: (client.drain(), len(client.text(req_id)) >= 3)[1])
    assert worker.engine.stats().num_blocks_free < start_free
    cancel(client.redis, client.keys, req_id)
    time.sleep(0.05)
    worker.run_once()
    final = client.final(req_id)
    assert final is not None and final.finish_reason == "abort"
    assert worker.engine.stats().num_blocks_free == start_free
    assert client.redis.hget(client.keys.request(req_id), "status") == b"finished_aborted"


def test_a_request_past_its_deadline_is_skipped_not_computed(redis_url, client, tiny):
    worker = make_service(redis_url, tiny, "w1")
    req_id = client.send(random_prompt(5, seed=4), SamplingParams(max_tokens=5),
                         deadline=time.time() - 1)
    run_until(worker, lambda: client.final(req_id))
    final = client.final(req_id)
    assert final.finish_reason == "error" and "deadline" in final.error
    assert worker.engine.stats().num_generated_tokens == 0


def test_a_poison_request_goes_to_the_dead_letter_stream(redis_url, client, tiny):
    keys = client.keys
    req_id = client.send(random_prompt(5, seed=5), SamplingParams(max_tokens=50, temperature=0))
    for name in ("crash-1", "crash-2"):  # two workers take it and die without a trace
        crasher = make_service(redis_url, tiny, name, max_deliveries=2)
        if name == "crash-1":
            crasher.run_once()
        else:
            time.sleep(0.4)
            crasher._claim_orphans()
        assert req_id in crasher.inflight
    time.sleep(0.4)
    survivor = make_service(redis_url, tiny, "survivor", max_deliveries=2)
    run_until(survivor, lambda: client.final(req_id))
    final = client.final(req_id)
    assert final.finish_reason == "error" and "dead-letter" in final.error
    dead = client.redis.xrange(keys.dead_letter(MODEL))
    assert [entry[1][b"id"].decode() for entry in dead] == [req_id]
    assert not survivor.engine.has_unfinished()


def test_work_that_does_not_fit_stays_in_the_stream(redis_url, client, tiny):
    keys = client.keys
    worker = make_service(redis_url, tiny, "w1")
    # 64 blocks of 4 tokens: the first request fills most of the pool, the second can't be admitted.
    big = client.send(random_prompt(200, seed=6),
                      SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    run_until(worker, lambda: big in worker.inflight and worker.engine.stats().num_running == 1)
    worker.run_once()
    other = client.send(random_prompt(120, seed=7), SamplingParams(max_tokens=4, temperature=0))
    worker.run_once()
    assert other not in worker.inflight
    group = client.redis.xinfo_groups(keys.queue(MODEL, "interactive", keys.shard_of(other)))[0]
    assert group["lag"] == 1  # still undelivered: any worker with room may take it
    run_until(worker, lambda: client.final(big))
    run_until(worker, lambda: client.final(other))
    assert client.final(other).finish_reason in ("stop", "length")


def test_the_worker_survives_a_redis_restart(tiny, tmp_path):
    import threading

    from kvfleet.shared.redis_server import EmbeddedRedis

    server = EmbeddedRedis().start()
    stop = threading.Event()
    service = make_service(server.url, tiny, "phoenix")
    thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
    thread.start()
    try:
        keys = Keys()
        redis_client = redis.Redis.from_url(server.url)
        deadline = time.monotonic() + 10
        while not redis_client.exists(keys.worker("phoenix")):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.stop()
        time.sleep(1.0)  # the worker backs off meanwhile
        server = EmbeddedRedis(port=server.port).start()
        client = Client(redis.Redis.from_url(server.url), keys)
        prompt = random_prompt(7, seed=8)
        deadline = time.monotonic() + 20
        while not client.redis.exists(keys.worker("phoenix")):  # heartbeat is back
            assert time.monotonic() < deadline, "worker did not reconnect"
            time.sleep(0.05)
        req_id = client.send(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        deadline = time.monotonic() + 20
        while client.final(req_id) is None:
            assert time.monotonic() < deadline, "request not served after the restart"
            time.sleep(0.05)
        assert client.text(req_id) == tiny.reference(prompt, 6)
    finally:
        stop.set()
        thread.join(timeout=10)
        server.stop()
    assert not thread.is_alive()


def test_a_device_failure_exits_the_worker_and_its_request_resumes_elsewhere(redis_url, client, tiny):
    """A sticky CUDA error poisons every later step: the worker exits without failing its
    requests, and another worker finishes them token for token."""
    import threading

    from kvfleet.worker.engine.memory.device import DeviceFailure

    prompt = random_prompt(10, seed=5)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    sick = make_service(redis_url, tiny, "sick")
    req_id = client.send(prompt, params)
    run_until(sick, lambda: (client.drain(), len(client.text(req_id)) >= 3)[1])

    def illegal_access(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    sick.engine.runner.execute = illegal_access
    with pytest.raises(DeviceFailure):
        sick.run(threading.Event())
    assert client.final(req_id) is None  # not failed: still pending for another worker
    assert not client.redis.exists(client.keys.worker("sick"))  # its heartbeat is gone at once

    time.sleep(0.4)  # its stream entry goes idle past the heartbeat TTL
    rescuer = make_service(redis_url, tiny, "rescuer")
    run_until(rescuer, lambda: client.final(req_id))
    assert client.final(req_id).finish_reason == "length"
    assert client.text(req_id) == tiny.reference(prompt, 12)


def test_prompt_logprobs_travel_in_the_first_event(redis_url, client, tiny):
    """The worker's prefill logprobs reach the gateway over Redis: once, equal to log_softmax of
    a transformers forward; with max_tokens 0 the final event carries them and no token."""
    import torch

    prompt = random_prompt(13, seed=31)
    with torch.inference_mode():
        want = torch.log_softmax(tiny.model(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    expected = want.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    worker = make_service(redis_url, tiny, "w1")
    scored = client.send(prompt, SamplingParams(max_tokens=0, prompt_logprobs=2))
    generated = client.send(prompt, SamplingParams(max_tokens=3, temperature=0,
                                                   prompt_logprobs=0))
    run_until(worker, lambda: client.final(scored) and client.final(generated))
    [final] = client.events[scored]
    assert final.finish_reason == "length" and final.token_ids == []
    assert final.usage.completion_tokens == 0
    carrying = [e for e in client.events[generated] if e.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0].seq == 0 and carrying[0].token_ids
    for entries, top_n in ((final.prompt_logprobs, 2), (carrying[0].prompt_logprobs, 0)):
        assert [e.token_id for e in entries] == prompt[1:]
        torch.testing.assert_close(torch.tensor([e.logprob for e in entries]), expected,
                                   atol=1e-4, rtol=1e-4)
        assert all(len(e.top) == top_n and e.rank >= 1 for e in entries)
