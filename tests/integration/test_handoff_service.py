"""KV handoffs between two worker services on a real Redis and a real TCP transfer plane (tiny
engines, stepped in turn by the test): a drain hands running streams (chunked, prefix-cached,
swapped out) to a peer that continues them without recompute; prefill and decode workers apart;
and every fallback: a taker that dies before or after fencing, a source that dies before
exporting, a lease that ends, a taker of another layout, a drain with no peer."""

from __future__ import annotations

import time

import pytest

from kvfleet.shared.settings import WorkerSettings
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.wire import SamplingParams
from tests.engine.tiny_models import TinyModel, random_prompt
from tests.helpers.channels import fleet_keys
from tests.integration.test_worker_service import MODEL, Client
from kvfleet.worker.handoff.transfer import TcpTransferPlane
from kvfleet.worker.protocol import WorkerProtocol
from kvfleet.worker.process.service import WorkerService

pytestmark = pytest.mark.topologies


@pytest.fixture(scope="module")
def tiny() -> TinyModel:
    return TinyModel("llama")


@pytest.fixture
def client(redis_client) -> Client:
    return Client(redis_client, fleet_keys(redis_client))


def service(redis_url: str, tiny: TinyModel, worker_id: str, *, num_blocks: int = 64,
            block_size: int = 4, engine_config: dict | None = None,
            handoffs: bool = True, numerics: str = "", **settings) -> WorkerService:
    """A worker of the tiny model; `numerics`: the fingerprint it says it computes with."""
    tracer_provider = settings.pop("tracer_provider", None)
    settings = WorkerSettings(
        redis_url=redis_url, model=MODEL, worker_id=worker_id,
        heartbeat_ttl_s=settings.pop("heartbeat_ttl_s", 0.5), heartbeat_interval_s=0.05,
        read_block_ms=10, **settings)
    redis_client = connect(redis_url)
    protocol = WorkerProtocol(redis_client, fleet_keys(redis_client), MODEL, worker_id,
                              result_ttl_s=60, numerics=numerics)
    engine = tiny.engine(num_blocks=num_blocks, block_size=block_size, **(engine_config or {}))
    plane = TcpTransferPlane("127.0.0.1", 0, "127.0.0.1") if handoffs else None
    worker = WorkerService(settings, engine, redis_client, protocol, plane=plane,
                           tracer_provider=tracer_provider)
    worker.connect()
    return worker


def step_all(workers, done, max_turns: int = 4000, timeout_s: float = 60) -> None:
    """Turn every worker's loop in turn until `done()`, each beating as its heartbeat thread
    would (every 50 ms); a worker whose drain ended stops."""
    deadline = time.monotonic() + timeout_s
    for _ in range(max_turns):
        if done():
            return
        for worker in workers:
            if worker.exited:
                continue
            if time.monotonic() - getattr(worker, "beat_at", 0.0) >= 0.05:
                worker.beat_at = time.monotonic()
                worker._snapshot_stats()
                worker._beat()
            worker.run_once()
            if worker.drainer.active and worker.drainer.over():
                worker.exited = True
                worker._shutdown()
        if time.monotonic() > deadline:
            break
    raise AssertionError("condition not reached")


def workers(*services):
    for worker in services:
        worker.exited = False
    return list(services)


def metric(worker: WorkerService, name: str, **labels) -> float:
    text = worker.metrics.render().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def reference_texts(redis_url, tiny, client, prompts, params, **config) -> list[list[int]]:
    """What an unmoved worker answers (same engine settings, one worker)."""
    ref = workers(service(redis_url, tiny, "ref", handoffs=False, **config))
    ids = [client.send(p, params) for p in prompts]
    step_all(ref, lambda: all(client.final(r) for r in ids))
    return [client.text(r) for r in ids]


def prefilled_tokens(worker: WorkerService) -> float:
    return metric(worker, "kvfleet_worker_prompt_tokens_total")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_drain_hands_running_streams_to_a_peer_that_continues_them_without_recompute(
        redis_url, client, tiny, temperature):
    params = SamplingParams(max_tokens=24, temperature=temperature, seed=5, ignore_eos=True)
    shared = random_prompt(16, seed=40)
    prompts = [random_prompt(30, seed=41), shared + random_prompt(6, seed=42),
               shared + random_prompt(9, seed=43)]
    expected = reference_texts(redis_url, tiny, client, prompts, params)

    # the source prefills in 8-token chunks; the second and third share a cached prefix
    source = service(redis_url, tiny, "source", engine_config={"max_batched_tokens": 8})
    ids = [client.send(p, params) for p in prompts]
    fleet = workers(source)
    step_all(fleet, lambda: all(len(client.text(r)) >= 3 for r in ids) or client.drain())
    assert source.engine.stats().prefix_hit_tokens > 0
    taker = service(redis_url, tiny, "taker")
    before = prefilled_tokens(taker)
    source.drain.set()
    fleet = workers(source, taker)
    step_all(fleet, lambda: all(client.final(r) for r in ids))
    assert [client.text(r) for r in ids] == expected
    assert source.exited  # the drain ended on its own, nothing left there
    assert metric(source, "kvfleet_worker_handoffs_total", direction="out") == 3
    assert metric(taker, "kvfleet_worker_handoffs_total", direction="in") == 3
    assert metric(taker, "kvfleet_worker_handoff_bytes_total", direction="in") > 0
    assert prefilled_tokens(taker) == before  # no prompt (or output) token computed again
    # the usage the client sees counts the source's prefix-cache hit
    assert max(client.final(r).usage.cached_tokens for r in ids[1:]) > 0
    assert not client.redis.hgetall(client.keys.handoff_offers(MODEL))


def test_a_stream_swapped_out_on_its_source_moves_with_its_host_copy(redis_url, client, tiny):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [random_prompt(20, seed=50 + i) for i in range(3)]
    expected = reference_texts(redis_url, tiny, client, prompts, params)
    # a pool too small for three streams' growth: the newest are swapped out
    source = service(redis_url, tiny, "source", num_blocks=30,
                     engine_config={"preemption": "swap", "swap_space_bytes": 1 << 24})
    ids = [client.send(p, params) for p in prompts]
    step_all(workers(source), lambda: source.engine.stats().num_swap_preemptions > 0)
    taker = service(redis_url, tiny, "taker")
    source.drain.set()
    step_all(workers(source, taker), lambda: all(client.final(r) for r in ids))
    assert [client.text(r) for r in ids] == expected
    assert metric(taker, "kvfleet_worker_handoffs_total", direction="in") >= 1


def test_prefill_and_decode_workers_apart(redis_url, client, tiny):
    params = SamplingParams(max_tokens=16, temperature=0.7, seed=9, ignore_eos=True)
    prompts = [random_prompt(25, seed=60 + i) for i in range(4)]
    expected = reference_texts(redis_url, tiny, client, prompts, params)
    # heartbeats that outlast a slow turn on a loaded host: an entry claimed as an orphan meanwhile
    # would be handed over twice (no worker dies here)
    prefill = service(redis_url, tiny, "prefill", role="prefill", heartbeat_ttl_s=5)
    decode = service(redis_url, tiny, "decode", role="decode", heartbeat_ttl_s=5)
    ids = [client.send(p, params) for p in prompts]
    step_all(workers(prefill, decode), lambda: all(client.final(r) for r in ids))
    assert [client.text(r) for r in ids] == expected
    # the decode worker took every stream from the prefill worker, and prefilled nothing
    assert metric(decode, "kvfleet_worker_handoffs_total", direction="in") == 4
    assert prefilled_tokens(decode) == 0
    assert metric(decode, "kvfleet_worker_requests_taken_total") == 0
    beat = client.redis.hgetall(client.keys.worker("decode"))
    assert beat[b"role"] == b"decode" and beat[b"handoffs_in"] == b"4"


def test_a_taker_that_dies_before_fencing_leaves_the_stream_to_its_source(redis_url, client,
                                                                           tiny):
    """The taker fetched the KV and died: the lease ends, the source continues from its own
    copy (no recompute), the answer is unchanged."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompt = random_prompt(18, seed=70)
    [expected] = reference_texts(redis_url, tiny, client, [prompt], params)
    source = service(redis_url, tiny, "source", role="prefill", handoff_lease_s=0.5)
    taker = service(redis_url, tiny, "taker", role="decode")
    req_id = client.send(prompt, params)
    step_all(workers(source), lambda: source.handoffs.offered)
    taker.run_once()  # takes the offer, fetches in its thread
    assert taker.handoffs.incoming
    step_all(workers(source), lambda: source.handoffs.handed)  # exported, sent
    future = next(iter(taker.handoffs.incoming.values())).future
    future.result(timeout=10)
    taker.handoffs.close()  # the taker dies here, before START_HANDOFF
    before = prefilled_tokens(source)
    step_all(workers(source), lambda: client.final(req_id))
    assert client.text(req_id) == expected
    assert metric(source, "kvfleet_worker_handoff_fallbacks_total", reason="lease_expired") == 1
    assert prefilled_tokens(source) == before  # continued from its own copy


def test_a_taker_that_dies_after_fencing_is_resumed_from_the_checkpoint(redis_url, client, tiny):
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True)
    prompt = random_prompt(14, seed=71)
    [expected] = reference_texts(redis_url, tiny, client, [prompt], params)
    source = service(redis_url, tiny, "source", role="prefill")
    taker = service(redis_url, tiny, "taker", role="decode")
    req_id = client.send(prompt, params)
    step_all(workers(source, taker), lambda: taker.handoffs.num_in == 1)
    step_all(workers(taker), lambda: (client.drain(), len(client.text(req_id)) >= 8)[1])
    # the taker dies without a word: no heartbeat, its entry goes idle; a rescuer resumes it
    taker.handoffs.close()
    client.redis.delete(client.keys.worker("taker"))
    time.sleep(0.6)
    rescuer = service(redis_url, tiny, "rescuer")
    step_all(workers(rescuer), lambda: client.final(req_id))
    assert client.text(req_id) == expected
    assert metric(rescuer, "kvfleet_worker_takeovers_total") == 1


def test_a_source_that_dies_before_handing_over_is_resumed_from_the_checkpoint(redis_url,
                                                                              client, tiny):
    """The taker asks a source whose plane is gone (it died) but whose heartbeat is still there:
    the fetch fails, nothing is fenced; once its heartbeat is gone a claimer resumes the
    stream."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompt = random_prompt(12, seed=72)
    [expected] = reference_texts(redis_url, tiny, client, [prompt], params)
    source = service(redis_url, tiny, "source", role="prefill")
    # built before the source dies: building it takes longer than the source's heartbeat lasts
    # on a loaded host, and then the taker finds the source gone and never tries the fetch
    taker = service(redis_url, tiny, "taker", role="decode", heartbeat_ttl_s=0.3)
    req_id = client.send(prompt, params)
    step_all(workers(source), lambda: source.handoffs.offered)
    source.handoffs.close()  # its transfer plane is gone with it; its heartbeat lasts 0.5 s
    step_all(workers(taker), lambda: client.final(req_id))
    assert client.text(req_id) == expected
    assert metric(taker, "kvfleet_worker_handoff_fallbacks_total", reason="transfer_failed") == 1
    assert metric(taker, "kvfleet_worker_takeovers_total") == 1


def test_offers_of_a_dead_source_are_dropped_not_taken(redis_url, client, tiny):
    """A source that died with standing offers: takers drop them without a fetch; its streams
    resume from their checkpoints."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompt = random_prompt(12, seed=76)
    [expected] = reference_texts(redis_url, tiny, client, [prompt], params)
    source = service(redis_url, tiny, "source", role="prefill")
    req_id = client.send(prompt, params)
    step_all(workers(source), lambda: source.handoffs.offered)
    source.handoffs.close()
    client.redis.delete(client.keys.worker("source"))  # gone: no heartbeat
    taker = service(redis_url, tiny, "taker", role="decode", heartbeat_ttl_s=0.3)
    step_all(workers(taker), lambda: client.final(req_id))
    assert client.text(req_id) == expected
    assert not client.redis.hgetall(client.keys.handoff_offers(MODEL))
    assert metric(taker, "kvfleet_worker_handoff_fallbacks_total") == 0
    assert metric(taker, "kvfleet_worker_takeovers_total") == 1


def test_a_taker_of_another_layout_resumes_from_the_checkpoint(redis_url, client, tiny):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = random_prompt(10, seed=73)
    [expected] = reference_texts(redis_url, tiny, client, [prompt], params)
    source = service(redis_url, tiny, "source", role="prefill")
    taker = service(redis_url, tiny, "taker", role="decode", block_size=8)
    req_id = client.send(prompt, params)
    step_all(workers(source, taker), lambda: client.final(req_id))
    assert client.text(req_id) == expected
    assert metric(taker, "kvfleet_worker_handoff_fallbacks_total", reason="incompatible") == 1


def test_a_drain_with_no_peer_finishes_what_it_can_and_gives_back_the_rest(redis_url, client,
                                                                           tiny):
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [random_prompt(10, seed=74), random_prompt(10, seed=75)]
    expected_long = reference_texts(redis_url, tiny, client, prompts[:1], params,
                                    num_blocks=256)[0]
    assert len(expected_long) == 400
    # Steps of at least 10 ms: the long answer (400 steps) cannot end within the drain's 1.5 s
    # on any host, the short one (6 steps) ends well within it even on a loaded one.
    source = service(redis_url, tiny, "source", num_blocks=256, drain_timeout_s=1.5)
    step = source.engine.step
    source.engine.step = lambda: (time.sleep(0.01), step())[1]
    long_id, short_id = client.send(prompts[0], params), client.send(prompts[1], short)
    step_all(workers(source), lambda: len(source.inflight) == 2)
    source.drain.set()
    fleet = workers(source)
    step_all(fleet, lambda: source.exited)
    assert client.final(short_id) is not None  # finished within the drain
    assert client.final(long_id) is None  # left, at once claimable by any live worker
    assert metric(source, "kvfleet_worker_handoff_fallbacks_total", reason="given_back") == 1
    rescuer = service(redis_url, tiny, "rescuer", num_blocks=256)
    step_all(workers(rescuer), lambda: client.final(long_id), timeout_s=120)
    assert client.text(long_id) == expected_long


def test_the_drain_key_starts_a_drain(redis_url, client, tiny):
    worker = service(redis_url, tiny, "w-key")
    client.redis.set(client.keys.drain("w-key"), "1", ex=60)
    worker._beat()
    assert worker.drain.is_set()
    step_all(workers(worker), lambda: worker.exited)
    assert not client.redis.exists(client.keys.drain("w-key"))


def drain_to_takers(redis_url, client, tiny, takers: dict[str, str], idle: tuple[str, ...] = ()):
    """A source of numerics fp_a drains 3 streams to workers of the given numerics (by id) with
    a long --numerics-prefer-ms; the workers in `idle` are alive (they beat) but their loops do
    not turn for the first second of the drain. Returns the requests, the source, the takers."""
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)
    prompts = [random_prompt(20, seed=90 + i) for i in range(3)]
    common = dict(numerics_prefer_ms=60_000, heartbeat_ttl_s=5.0)
    source = service(redis_url, tiny, "source", numerics="fp_a", **common)
    ids = [client.send(p, params) for p in prompts]
    step_all(workers(source), lambda: client.drain() or all(len(client.text(r)) >= 3
                                                              for r in ids))
    peers = {w: service(redis_url, tiny, w, numerics=fp, **common) for w, fp in takers.items()}
    source.drain.set()
    started = time.monotonic()
    busy = [peer for w, peer in peers.items() if w not in idle]
    step_all(workers(source, *busy), lambda: time.monotonic() - started > 1.0, max_turns=10**6)
    step_all(workers(source, *peers.values()), lambda: all(client.final(r) for r in ids),
             max_turns=10**6)
    return ids, source, peers


def test_a_drain_hands_its_streams_to_a_worker_of_its_numerics_first(redis_url, client, tiny):
    """A worker of other numerics leaves the offers to a live worker of the source's, even while
    that one is idle for a second; the streams end on the source's numerics alone."""
    ids, source, peers = drain_to_takers(redis_url, client, tiny,
                                         {"twin": "fp_a", "stranger": "fp_b"}, idle=("twin",))
    assert metric(peers["twin"], "kvfleet_worker_handoffs_total", direction="in") == 3
    assert metric(peers["stranger"], "kvfleet_worker_handoffs_total", direction="in") == 0
    assert [client.final(r).numerics for r in ids] == ["fp_a"] * 3
    assert metric(peers["twin"], "kvfleet_worker_resumes_other_numerics_total") == 0


def test_with_no_worker_of_its_numerics_a_drain_hands_over_at_once_and_says_so(redis_url,
                                                                              client, tiny):
    ids, source, peers = drain_to_takers(redis_url, client, tiny, {"stranger": "fp_b"})
    assert metric(peers["stranger"], "kvfleet_worker_handoffs_total", direction="in") == 3
    assert [client.final(r).numerics for r in ids] == ["fp_a+fp_b"] * 3
    assert metric(peers["stranger"], "kvfleet_worker_resumes_other_numerics_total") == 3
    assert client.redis.hget(client.keys.request(ids[0]), "numerics") == b"fp_a+fp_b"

