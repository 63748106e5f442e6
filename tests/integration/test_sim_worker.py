"""Simulated workers (worker/sim/) behind the real worker service and a real Redis (and a real
Redis Cluster): they serve, a dead one's stream resumes on another without a seam, their
heartbeats and metrics say what they simulate and how many steps they played late, and one
process runs several of them (`kvfleet worker --sim-workers N`)."""

from __future__ import annotations

import threading
import time

import pytest

from kvfleet.shared.engine_config import EngineConfig
from kvfleet.shared.models import default_cache_dir
from kvfleet.shared.settings import WorkerSettings
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.wire import Heartbeat, SamplingParams
from tests.engine.tiny_models import random_prompt
from tests.helpers.channels import fleet_keys
from tests.integration.test_handoff_service import metric, prefilled_tokens, step_all, workers
from tests.integration.test_worker_service import MODEL, client, run_until  # noqa: F401 (fixture)
from tests.sim.test_sim_engine import LinearCost
from kvfleet.worker.handoff.transfer import TcpTransferPlane
from kvfleet.worker.protocol import WorkerProtocol
from kvfleet.worker.process.service import WorkerService
from kvfleet.worker.sim.clock import StepClock
from kvfleet.worker.sim.engine import SimEngine
from kvfleet.worker.sim.tokens import AnswerLengths

pytestmark = pytest.mark.topologies


def sim_service(redis_url: str, worker_id: str, answers: str = "max",
                handoffs: bool = False, **settings) -> WorkerService:
    settings = WorkerSettings(redis_url=redis_url, model=MODEL, worker_id=worker_id,
                              heartbeat_ttl_s=settings.pop("heartbeat_ttl_s", 0.3),
                              heartbeat_interval_s=0.05, read_block_ms=10, **settings)
    engine = SimEngine(EngineConfig(device="cpu", block_size=4, pace_warmup=False),
                       LinearCost(base_s=0.002, token_s=0.0001), vocab_size=49152,
                       eos_token_ids=[2], max_model_len=2048, num_blocks=128,
                       answer_lengths=AnswerLengths.parse(answers), clock=StepClock(1.0),
                       kv_bytes_per_token=4096)
    client = connect(redis_url)
    protocol = WorkerProtocol(client, fleet_keys(client), MODEL, worker_id, result_ttl_s=60,
                              numerics=engine.numerics.fingerprint)
    plane = TcpTransferPlane("127.0.0.1", 0, "127.0.0.1") if handoffs else None
    service = WorkerService(settings, engine, client, protocol, plane=plane)
    service.connect()
    return service


def test_a_dead_simulated_workers_stream_resumes_on_another_without_a_seam(redis_url, client):
    prompt = random_prompt(30, seed=4)
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=3)
    reference = sim_service(redis_url, "sim-ref", answers="fixed:33")
    ref_id = client.send(prompt, params)
    run_until(reference, lambda: client.final(ref_id))
    expected = client.text(ref_id)
    final = client.final(ref_id)
    assert len(expected) == 33 and final.finish_reason == "stop"  # the drawn length's EOS

    dying = sim_service(redis_url, "sim-dying", answers="fixed:33")
    req_id = client.send(prompt, params)
    run_until(dying, lambda: (client.drain(), len(client.text(req_id)) >= 8)[1])
    time.sleep(0.4)  # `dying` stops without a word; its heartbeat lapses
    rescuer = sim_service(redis_url, "sim-rescuer", answers="fixed:33")
    run_until(rescuer, lambda: client.final(req_id))
    assert client.text(req_id) == expected
    assert max(e.attempt for e in client.events[req_id]) == 2
    assert client.redis.hget(client.keys.request(req_id), "worker") == b"sim-rescuer"

    rescuer._beat()
    beat = Heartbeat.decode(client.redis.hgetall(client.keys.worker("sim-rescuer")))
    assert beat.simulated.startswith("linear test cost; time scale 1")
    assert beat.sim_steps == rescuer.engine.stats().sim_steps > 0
    assert beat.numerics == reference.engine.numerics.fingerprint
    text = rescuer.metrics.render().decode()
    assert f'kvfleet_worker_sim_steps_total{{model="{MODEL}",worker="sim-rescuer"}} ' \
        f'{float(beat.sim_steps)}' in text
    assert f'kvfleet_worker_sim_lagged_steps_total{{model="{MODEL}",worker="sim-rescuer"}}' in text


def test_simulated_prefill_and_decode_workers_apart_hand_streams_over(redis_url, client):
    """--role prefill / decode between simulated workers: the decode worker takes every stream
    after its first token with its KV's modelled size (no bytes of KV), prefills nothing, and
    the answers are those one worker gives."""
    params = SamplingParams(max_tokens=16, temperature=0.7, seed=9, ignore_eos=True)
    prompts = [random_prompt(25, seed=80 + i) for i in range(4)]
    ref = workers(sim_service(redis_url, "sim-one"))
    ref_ids = [client.send(p, params) for p in prompts]
    step_all(ref, lambda: all(client.final(r) for r in ref_ids))
    expected = [client.text(r) for r in ref_ids]
    prefill = sim_service(redis_url, "sim-prefill", handoffs=True, role="prefill",
                          heartbeat_ttl_s=0.5)
    decode = sim_service(redis_url, "sim-decode", handoffs=True, role="decode",
                         heartbeat_ttl_s=0.5)
    ids = [client.send(p, params) for p in prompts]
    step_all(workers(prefill, decode), lambda: all(client.final(r) for r in ids))
    assert [client.text(r) for r in ids] == expected
    assert metric(decode, "kvfleet_worker_handoffs_total", direction="in") == 4
    assert prefilled_tokens(decode) == 0 and prefilled_tokens(prefill) == 4 * 25
    # counted as the KV's modelled size: 25 prompt tokens in 7 blocks of 4, 4096 bytes a token
    assert metric(prefill, "kvfleet_worker_handoff_bytes_total", direction="out") == \
        4 * 7 * 4 * 4096


def test_one_process_runs_several_simulated_workers_of_a_shape_without_its_weights(
        redis_url, client):
    """`kvfleet worker --sim-workers 3 --sim-device h100 --model random:llama-3.1-70b`: the
    model's config and tokenizer only (no weights are made), three workers with their own
    names, pools of the H100's memory beside 70B's weights at tensor parallel 2, one metrics
    endpoint; they serve, and stop when asked."""
    from kvfleet.worker.sim.host import run_sim_workers

    keys = client.keys
    settings = WorkerSettings(
        redis_url=redis_url, model="random:llama-3.1-70b", served_model_name=[MODEL],
        sim_workers=3, sim_device="h100", tensor_parallel_size=2, worker_id="simhost",
        heartbeat_interval_s=0.05, read_block_ms=10, metrics_host="127.0.0.1",
        key_prefix=keys.prefix, queue_shards=keys.queue_shards)
    stop = threading.Event()
    host = threading.Thread(target=run_sim_workers, args=(settings, stop))
    host.start()
    try:
        names = [f"simhost-s{i}" for i in range(3)]
        deadline = time.monotonic() + 120
        while not all(client.redis.exists(keys.worker(n)) for n in names):
            assert time.monotonic() < deadline and host.is_alive(), "no heartbeats"
            time.sleep(0.1)
        beats = [Heartbeat.decode(client.redis.hgetall(keys.worker(n))) for n in names]
        assert all("llama-3.1-70b" in b.simulated and "h100" in b.simulated for b in beats)
        # 70B in bf16 over 2 H100s: ~65 GiB of weights each, ~5 GiB of KV a device left
        per_token_per_device = 2 * 80 * 4 * 128 * 2
        blocks = beats[0].blocks_total
        assert 3.0 * 2**30 < blocks * 16 * per_token_per_device < 7.5 * 2**30
        assert len({b.metrics_url for b in beats}) == 1 and beats[0].metrics_url
        req_id = client.send(random_prompt(40, seed=9),
                             SamplingParams(max_tokens=12, ignore_eos=True))
        deadline = time.monotonic() + 30
        while client.final(req_id) is None:
            assert time.monotonic() < deadline, "the simulated fleet did not answer"
            time.sleep(0.05)
        assert len(client.text(req_id)) == 12
        # only the config and tokenizer were made (the models' cache is the user's default)
        cache = default_cache_dir()
        assert (cache / "random-llama-3.1-70b-config" / "config.json").is_file()
        assert not (cache / "random-llama-3.1-70b").exists()
    finally:
        stop.set()
        host.join(timeout=60)
    assert not host.is_alive()


def test_simulated_workers_make_the_spans_a_real_worker_makes(redis_url, client):
    """--otlp-traces-endpoint reaches simulated workers too: a request with the gateway's trace
    context gets its worker span from the simulated worker that served it, in that trace."""
    from tests.helpers.otlp import Receiver, span_attributes
    from kvfleet.worker.sim.host import run_sim_workers

    keys = client.keys
    receiver = Receiver()
    settings = WorkerSettings(
        redis_url=redis_url, model="random:llama-3.1-8b", served_model_name=[MODEL],
        sim_workers=2, sim_device="h100", worker_id="simtrace", heartbeat_interval_s=0.05,
        read_block_ms=10, metrics_port=-1, key_prefix=keys.prefix,
        queue_shards=keys.queue_shards, otlp_traces_endpoint=receiver.url)
    stop = threading.Event()
    host = threading.Thread(target=run_sim_workers, args=(settings, stop))
    host.start()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    try:
        deadline = time.monotonic() + 60
        while not all(client.redis.exists(keys.worker(f"simtrace-s{i}")) for i in range(2)):
            assert time.monotonic() < deadline and host.is_alive(), "no heartbeats"
            time.sleep(0.1)
        req_id = client.send(random_prompt(20, seed=5),
                             SamplingParams(max_tokens=6, ignore_eos=True),
                             traceparent=f"00-{trace_id}-00f067aa0ba902b7-01")
        while client.final(req_id) is None:
            assert time.monotonic() < deadline, "no answer"
            time.sleep(0.05)
    finally:
        stop.set()
        host.join(timeout=60)  # the provider's shutdown exports the last spans
        receiver.close()
    spans = [(resource, span) for resource, span in receiver.spans() if span.name == "worker"]
    assert len(spans) == 1
    resource, span = spans[0]
    assert span.trace_id.hex() == trace_id and span.parent_span_id.hex() == "00f067aa0ba902b7"
    assert resource["service.instance.id"] == "simtrace"
    assert span_attributes(span)["gen_ai.usage.output_tokens"] == 6
